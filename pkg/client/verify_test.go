package client_test

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
)

// TestBadReplicaDropped: a memory replica whose bytes changed in place (the
// agent never reads a memory object through a check of its own) is read
// first by Get, BatchGet and GetTo; each falls back to the intact replica
// and asks the bad one's agent to verify it (TRANSFER_OP_VERIFY on the
// bulk path, DataService.Verify on the gRPC one), which drops it and
// reports it lost: the master then lists only the intact replica. Before,
// the bad replica stayed listed, and every get paid for its bytes before
// it fell back (on the gRPC path, until DataService.Verify, for good).
func TestBadReplicaDropped(t *testing.T) {
	h := start(t, testcluster.Options{})
	paths(t, func(t *testing.T, transfer bool) {
		testBadReplicaDropped(t, h, h.pathClient(t, transfer)) // on host-0: reads host-0's replica first
	})
}

func testBadReplicaDropped(t *testing.T, h *harness, c *client.Client) {
	tenant, ctx := c.TenantName(), t.Context()
	for _, size := range []int{100, 100<<10 + 3} { // batched small reads, and reads of their own
		data := pattern(size, 5)
		for _, get := range []struct {
			name string
			get  func(key string) ([]byte, error)
		}{
			{"Get", func(key string) ([]byte, error) { return c.Get(ctx, key) }},
			{"BatchGet", func(key string) ([]byte, error) {
				out, errs := c.BatchGet(ctx, []string{key})
				return out[0], errs[0]
			}},
			{"GetTo", func(key string) ([]byte, error) {
				var buf bytes.Buffer
				_, err := c.GetTo(ctx, key, &buf, nil)
				return buf.Bytes(), err
			}},
		} {
			t.Run(fmt.Sprintf("%s/%d", get.name, size), func(t *testing.T) {
				key := fmt.Sprintf("verify/%s/%d", get.name, size)
				if err := c.Put(ctx, key, data, client.WithReplicas(2)); err != nil {
					t.Fatal(err)
				}
				h.Corrupt(tenant, key, h.replicaOn(t, tenant, key, "host-0"))
				got, err := get.get(key)
				if get.name == "GetTo" {
					// Streamed into a writer it cannot rewind: the corrupt
					// bytes reached it, and the call fails.
					if err == nil {
						t.Fatal("GetTo of a corrupt first replica into a bytes.Buffer succeeded")
					}
				} else if err != nil || !bytes.Equal(got, data) {
					t.Fatalf("%s with host-0's replica corrupt = %v (bytes equal %v)", get.name, err, bytes.Equal(got, data))
				}
				testutil.EventuallyNoError(t, 10*time.Second, func() error {
					info, err := c.Stat(ctx, key)
					if err != nil {
						return err
					}
					if len(info.Replicas) != 1 || info.Replicas[0].GetHostId() != "host-1" {
						hosts := []string{}
						for _, r := range info.Replicas {
							hosts = append(hosts, r.GetHostId())
						}
						return fmt.Errorf("replicas on %v, want host-1 only (host-0's dropped)", hosts)
					}
					return nil
				})
				if got, err := c.Get(ctx, key); err != nil || !bytes.Equal(got, data) {
					t.Fatalf("Get after the drop = %v", err)
				}
			})
		}
	}
}
