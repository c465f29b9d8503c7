package app

import (
	"fmt"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/link"
	"github.com/crescent-kv/crescent/internal/testutil"
)

// recvRegister receives an agent's registration: its Register and, when
// chunked, the table's RegisterChunk messages, which the fake masters of
// these tests fold back into Register.allocations. These masters follow no
// agent: they answer a resume Register with TableRequest, and the agent
// registers again in full.
func recvRegister(stream masterv1.SegmentService_ConnectServer) (*masterv1.Register, error) {
	first, err := stream.Recv()
	if err != nil {
		return nil, err
	}
	r := first.GetRegister()
	if r.GetResume() {
		if err := stream.Send(&masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_TableRequest{TableRequest: &masterv1.TableRequest{Reason: "fake master"}}}); err != nil {
			return nil, err
		}
		if first, err = stream.Recv(); err != nil {
			return nil, err
		}
		if r = first.GetRegister(); r == nil || r.GetResume() {
			return nil, fmt.Errorf("fake master: got %v after TableRequest, want a full Register", first)
		}
	}
	for r.GetChunked() {
		msg, err := stream.Recv()
		if err != nil {
			return nil, err
		}
		ch := msg.GetRegisterChunk()
		if ch == nil {
			return nil, fmt.Errorf("fake master: got %T inside the registration", msg.GetMsg())
		}
		for _, a := range ch.GetAllocations() {
			a.SegmentId = ch.GetSegmentId()
		}
		r.Allocations = append(r.Allocations, ch.GetAllocations()...)
		if ch.GetLast() {
			break
		}
	}
	return r, nil
}

// TestAgentWithStandbysResumes: with several masters (the second one down)
// the agent keeps a table feed: its Connect offers to resume at the feed's
// position, and registers in full, with the position, when the master
// asks for the table (recvRegister).
func TestAgentWithStandbysResumes(t *testing.T) {
	m, addr := startMaster(t)
	r := startAgentWith(t, addr, t.TempDir(), func(c *Config) { c.Master = addr + ",127.0.0.1:1" })
	defer r.stop(t)
	c := <-m.conns
	if p := c.reg.GetTablePosition(); len(p.GetInstance()) != 32 || p.GetVersion() != 0 || c.reg.GetResume() {
		t.Fatalf("Register table_position %v, resume %v; want the feed's instance at version 0 and a full registration", p, c.reg.GetResume())
	}
	c.out <- settingsMsg()
	testutil.Eventually(t, 5*time.Second, func() bool { return r.agent.Link().State() == link.StateConnected }, "connected")
}
