package ctl

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	agentapp "github.com/crescent-kv/crescent/internal/agent/app"
	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
)

// crescentctl's commands through Main (cobra root, flags, exit codes,
// stdout and stderr) against a real in-process cluster (testcluster).

// runIn is run with stdin.
func runIn(t *testing.T, addr, stdin string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = Main(t.Context(), append([]string{"--master", addr}, args...), strings.NewReader(stdin), &out, &errb)
	return code, out.String(), errb.String()
}

// jsonLines decodes stdout's JSON lines.
func jsonLines(t *testing.T, out string) []map[string]any {
	t.Helper()
	var rows []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("stdout line %q is not JSON: %v", line, err)
		}
		rows = append(rows, m)
	}
	return rows
}

func TestPutGetStat(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{})
	addr := c.MasterAddr()
	// The agents' gRPC DataService calls: --grpc-data moves every byte
	// through them, the default moves none (the bulk transfer listeners
	// are not counted).
	dataCalls := func() int { return c.Calls("Write") + c.Calls("Read") + c.Calls("BatchWrite") + c.Calls("BatchRead") }
	for _, grpcData := range []bool{false, true} {
		name := map[bool]string{false: "transfer", true: "grpc-data"}[grpcData]
		t.Run(name, func(t *testing.T) {
			// A tenant per subtest: the same keys, in a cluster they share.
			global := []string{"--tenant", name}
			if grpcData {
				global = append(global, "--grpc-data")
			}
			before := dataCalls()
			dir := t.TempDir()
			src := filepath.Join(dir, "in")
			data := bytes.Repeat([]byte("0123456789abcdef"), 40<<10) // 640 KiB: streamed
			if err := os.WriteFile(src, data, 0o600); err != nil {
				t.Fatal(err)
			}
			args := append(global, "put", "--replicas", "2", "--group", "g7", "--soft-pin", "--hard-pin", "big", src)
			if code, out, errOut := run(t, addr, args...); code != ExitOK || out != "" || !strings.Contains(errOut, "stored big (655360 bytes)") {
				t.Fatalf("put file: exit %d, stdout %q, stderr %q", code, out, errOut)
			}
			if got, err := tenantClient(t, c, name).Get(t.Context(), "big"); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("the cluster holds %d bytes (%v), want %d", len(got), err, len(data))
			}
			code, out, errOut := runIn(t, addr, "from stdin", append(global, "-o", "json", "put", "--soft-pin=2h", "--medium", "memory", "small", "-")...)
			if rows := jsonLines(t, out); code != ExitOK || len(rows) != 1 || rows[0]["key"] != "small" || rows[0]["size"] != 10.0 {
				t.Fatalf("put stdin: exit %d, stdout %q, stderr %q", code, out, errOut)
			}
			if code, out, errOut := run(t, addr, append(global, "put", "--upsert", "small", src)...); code != ExitOK {
				t.Fatalf("put --upsert: exit %d, stdout %q, stderr %q", code, out, errOut)
			}
			if code, _, errOut := runIn(t, addr, "x", append(global, "put", "small", "-")...); code != ExitError || !strings.Contains(errOut, "OBJECT_ALREADY_EXISTS") {
				t.Fatalf("put over an existing key: exit %d, stderr %q", code, errOut)
			}

			// get to stdout, to a file, and to stdout with -o -.
			if code, out, errOut := run(t, addr, append(global, "get", "big")...); code != ExitOK || out != string(data) {
				t.Fatalf("get: exit %d, %d bytes on stdout, stderr %q", code, len(out), errOut)
			}
			dst := filepath.Join(dir, "out")
			if code, out, errOut := run(t, addr, append(global, "-o", dst, "get", "big")...); code != ExitOK || out != "" {
				t.Fatalf("get -o file: exit %d, stdout %q, stderr %q", code, out, errOut)
			}
			if got, err := os.ReadFile(dst); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("get -o file wrote %d bytes, %v", len(got), err)
			}
			if code, out, _ := run(t, addr, append(global, "-o", "-", "get", "small")...); code != ExitOK || out != string(data) {
				t.Fatalf("get -o -: exit %d, %d bytes", code, len(out))
			}
			if code, _, errOut := run(t, addr, append(global, "get", "missing")...); code != ExitNotFound || !strings.Contains(errOut, "OBJECT_NOT_FOUND") {
				t.Fatalf("get missing: exit %d, stderr %q", code, errOut)
			}
			if code, _, _ := run(t, addr, append(global, "-o", filepath.Join(dir, "no", "such", "dir"), "get", "big")...); code != ExitError {
				t.Fatalf("get into an impossible path: exit %d", code)
			}

			// Two replicas on two hosts (the master spreads them), in either
			// order; replica ids are the master's, unique across objects.
			code, out, _ = run(t, addr, append(global, "stat", "big")...)
			for _, want := range []string{"key:      big\n", "size:     655360\n", "media:    cpu\n", "group:    g7\n"} {
				if code != ExitOK || !strings.Contains(out, want) {
					t.Fatalf("stat: exit %d, stdout %q, want %q in it", code, out, want)
				}
			}
			for _, host := range []string{"host-0", "host-1"} {
				re := regexp.MustCompile(`(?m)^replica [1-9][0-9]*: COMPLETE on ` + host + ` \(127\.0\.0\.1:[0-9]+, transfer 127\.0\.0\.1:[0-9]+, segment [0-9a-f-]{36}\) cpu$`)
				if n := len(re.FindAllString(out, -1)); n != 1 {
					t.Fatalf("stat: stdout %q has %d replica lines on %s, want 1", out, n, host)
				}
			}
			code, out, _ = run(t, addr, append(global, "-o", "json", "stat", "big")...)
			rows := jsonLines(t, out)
			if code != ExitOK || len(rows) != 1 || rows[0]["group_id"] != "g7" || len(rows[0]["replicas"].([]any)) != 2 {
				t.Fatalf("stat -o json: exit %d, stdout %q", code, out)
			}
			hosts, ids := map[any]bool{}, map[any]bool{}
			for _, r := range rows[0]["replicas"].([]any) {
				r := r.(map[string]any)
				if r["status"] != "COMPLETE" || r["medium"] != "cpu" || r["transfer_endpoint"] == "" || r["replica_id"] == 0.0 {
					t.Fatalf("stat -o json: replica %v", r)
				}
				hosts[r["host_id"]], ids[r["replica_id"]] = true, true
			}
			if !hosts["host-0"] || !hosts["host-1"] || len(ids) != 2 {
				t.Fatalf("stat -o json: replicas %v on %v, want two on host-0 and host-1", ids, hosts)
			}
			if code, _, _ := run(t, addr, append(global, "stat", "missing")...); code != ExitNotFound {
				t.Fatalf("stat missing: exit %d, want %d", code, ExitNotFound)
			}

			if n := dataCalls() - before; grpcData && n == 0 {
				t.Fatal("--grpc-data moved no bytes through the agents' DataService")
			} else if !grpcData && n != 0 {
				t.Fatalf("without --grpc-data, %d DataService calls; want every byte over the transfer listeners", n)
			}
		})
	}
}

func TestUsageErrors(t *testing.T) {
	// No command here gets as far as moving bytes: a master is enough.
	c := testcluster.Start(t, testcluster.Options{Agents: -1})
	dir := t.TempDir()
	for _, args := range [][]string{
		{"put", "k"},
		{"put", "--medium", "tape", "k", "-"},
		{"put", "--soft-pin=forever", "k", "-"},
		{"get"},
		{"stat", "a", "b"},
		{"rm"},
		{"rm", "--all", "--prefix", "p"},
		{"ls", "extra"},
		{"-o", "yaml", "ls"},
		{"--no-such-flag", "ls"},
		{"watch", "--gateway", "tcp://127.0.0.1:1", "--from-seq", "5"},
		{"bench", "--batch", "0"},
		{"bench", "--mode", "sideways"},
	} {
		if code, _, errOut := run(t, c.MasterAddr(), args...); code != ExitUsage || !strings.HasPrefix(errOut, "crescentctl: ") {
			t.Errorf("crescentctl %v: exit %d, stderr %q; want %d", args, code, errOut, ExitUsage)
		}
	}
	// get KEY FILE, as put takes them: the error says how to write a file.
	if code, _, errOut := run(t, c.MasterAddr(), "get", "k", "out.bin"); code != ExitUsage || !strings.Contains(errOut, "crescentctl get k -o out.bin") {
		t.Errorf("crescentctl get k out.bin: exit %d, stderr %q; want %d naming -o", code, errOut, ExitUsage)
	}
	if code, _, _ := run(t, c.MasterAddr(), "put", "k", filepath.Join(dir, "missing")); code != ExitError {
		t.Errorf("put of a missing file: exit %d, want %d", code, ExitError)
	}
}

func TestRemoveAndList(t *testing.T) {
	// The read lease that makes rm skip d must outlast the test on a
	// loaded machine.
	c := testcluster.Start(t, testcluster.Options{Master: func(cfg *masterapp.Config) { cfg.LeaseTTL = 5 * time.Minute }})
	addr := c.MasterAddr()
	seed(t, c,
		client.Item{Key: "a/1", Data: []byte("1")}, client.Item{Key: "a/2", Data: []byte("22")},
		client.Item{Key: "b/1", Data: []byte("333")}, client.Item{Key: "b/2", Data: []byte("4444")},
		client.Item{Key: "c/1", Data: []byte("5")}, client.Item{Key: "c/2", Data: []byte("6")}, client.Item{Key: "d", Data: []byte("7")})

	code, out, _ := run(t, addr, "ls", "--prefix", "b/")
	if want := "KEY"; code != ExitOK || !strings.HasPrefix(out, want) || !strings.Contains(out, "b/2") || strings.Contains(out, "a/1") {
		t.Fatalf("ls --prefix b/: exit %d, stdout %q", code, out)
	}
	code, out, _ = run(t, addr, "-o", "json", "ls")
	rows := jsonLines(t, out)
	if code != ExitOK || len(rows) != 7 || rows[3]["key"] != "b/2" || rows[3]["size"] != 4.0 || rows[3]["media"].([]any)[0] != "cpu" {
		t.Fatalf("ls -o json: exit %d, stdout %q", code, out)
	}

	if code, _, errOut := run(t, addr, "rm", "a/1"); code != ExitOK || errOut != "removed 1, skipped 0\n" {
		t.Fatalf("rm a/1: exit %d, stderr %q", code, errOut)
	}
	if code, _, errOut := run(t, addr, "rm", "a/1"); code != ExitNotFound || !strings.Contains(errOut, "OBJECT_NOT_FOUND") {
		t.Fatalf("rm a/1 again: exit %d, stderr %q", code, errOut)
	}
	code, out, errOut := run(t, addr, "-o", "json", "rm", "a/2", "missing", "b/1")
	if code != ExitNotFound || out != `{"removed":2,"skipped":1}`+"\n" || !strings.Contains(errOut, `"missing"`) {
		t.Fatalf("rm of three keys, one missing: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if code, _, errOut := run(t, addr, "rm", "--regex", "^c/"); code != ExitOK || errOut != "removed 2, skipped 0\n" {
		t.Fatalf("rm --regex: exit %d, stderr %q", code, errOut)
	}
	// A read lease makes rm --all skip d until --force.
	if code, _, _ := run(t, addr, "get", "d"); code != ExitOK {
		t.Fatal("get d")
	}
	if code, out, _ := run(t, addr, "-o", "json", "rm", "--all"); code != ExitOK || out != `{"removed":1,"skipped":1}`+"\n" {
		t.Fatalf("rm --all: exit %d, stdout %q", code, out)
	}
	if code, _, errOut := run(t, addr, "rm", "d"); code != ExitError || !strings.Contains(errOut, "OBJECT_HAS_LEASE") {
		t.Fatalf("rm of a leased key: exit %d, stderr %q", code, errOut)
	}
	if code, _, errOut := run(t, addr, "rm", "--all", "--force"); code != ExitOK || errOut != "removed 1, skipped 0\n" {
		t.Fatalf("rm --all --force: exit %d, stderr %q", code, errOut)
	}
	if keys := c.Keys("default"); len(keys) != 0 {
		t.Fatalf("left %v", keys)
	}
	if code, _, _ := run(t, addr, "rm", "--regex", "("); code != ExitError {
		t.Fatalf("rm --regex of a bad regex: exit %d", code)
	}
}

func TestAdminCommands(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{Master: func(cfg *masterapp.Config) { cfg.MasterID = "cli-master" }})
	addr := c.MasterAddr()
	seed(t, c, client.Item{Key: "k", Data: []byte("hello")})
	// Agents report their segments' use in heartbeats: wait for the one
	// holding k's replica to count it.
	holder := ""
	testutil.EventuallyNoError(t, 20*time.Second, func() error {
		for _, s := range segments(t, c) {
			if s.GetReplicas() == 1 && s.GetInfo().GetUsed() > 0 {
				holder = s.GetInfo().GetSegmentId()
				return nil
			}
		}
		return fmt.Errorf("no segment reports k's replica in use yet")
	})
	want := map[string]*masterv1.Segment{}
	for _, s := range segments(t, c) {
		want[s.GetInfo().GetSegmentId()] = s
	}

	code, out, _ := run(t, addr, "segments")
	if code != ExitOK || !strings.HasPrefix(out, "SEGMENT") || strings.Count(out, " OK ") != 2 || strings.Count(out, "HEALTHY") != 2 {
		t.Fatalf("segments: exit %d, stdout %q", code, out)
	}
	for id := range want {
		if !strings.Contains(out, id) {
			t.Fatalf("segments: stdout %q lacks %s", out, id)
		}
	}
	code, out, _ = run(t, addr, "-o", "json", "segments")
	rows := jsonLines(t, out)
	if code != ExitOK || len(rows) != 2 {
		t.Fatalf("segments -o json: exit %d, stdout %q", code, out)
	}
	for _, r := range rows {
		// What the master lists, and k's one replica on holder alone.
		s := want[r["segment_id"].(string)]
		replicas := map[bool]float64{false: 0, true: 1}[r["segment_id"] == holder]
		if s == nil || r["agent_id"] != s.GetAgentId() || r["host_id"] != s.GetHostId() || r["medium"] != "cpu" || r["lifecycle"] != "OK" || r["health"] != "HEALTHY" ||
			r["used"] != float64(s.GetInfo().GetUsed()) || (r["used"] == 0.0) != (replicas == 0) || r["capacity"] != float64(32<<20) || r["replicas"] != replicas ||
			r["can_allocate"] != true || r["can_serve_read"] != true {
			t.Fatalf("segments -o json: row %v; the master lists %v (k's replica on %s)", r, s, holder)
		}
	}

	code, out, _ = run(t, addr, "agents")
	if code != ExitOK || !strings.HasPrefix(out, "AGENT") || !strings.Contains(out, "agent-1") || !strings.Contains(out, c.Agent(1).TransferEndpoint()) {
		t.Fatalf("agents: exit %d, stdout %q", code, out)
	}
	code, out, _ = run(t, addr, "-o", "json", "agents")
	rows = jsonLines(t, out)
	if code != ExitOK || len(rows) != 2 {
		t.Fatalf("agents -o json: exit %d, stdout %q", code, out)
	}
	for _, r := range rows {
		i := map[any]int{"agent-0": 0, "agent-1": 1}[r["agent_id"]]
		segs, _ := r["segments"].([]any)
		if r["agent_id"] != fmt.Sprintf("agent-%d", i) || r["host_id"] != fmt.Sprintf("host-%d", i) || r["endpoint"] != c.Agent(i).DataEndpoint() ||
			r["transfer_endpoint"] != c.Agent(i).TransferEndpoint() || r["connected"] != true || r["last_heartbeat_unix_ms"] == 0.0 ||
			len(segs) != 1 || want[segs[0].(string)].GetAgentId() != r["agent_id"] {
			t.Fatalf("agents -o json: row %v", r)
		}
	}

	code, out, _ = run(t, addr, "--tenant", "t9", "quota", "set", "--max-bytes", "1000", "--max-objects", "3")
	if code != ExitOK || out != "tenant t9: bytes 0/1000 objects 0/3 (0 = unlimited)\n" {
		t.Fatalf("quota set: exit %d, stdout %q", code, out)
	}
	code, out, _ = run(t, addr, "--tenant", "t9", "quota", "get")
	if code != ExitOK || out != "tenant t9: bytes 0/1000 objects 0/3 (0 = unlimited)\n" {
		t.Fatalf("quota get of the quota just set: exit %d, stdout %q", code, out)
	}
	code, out, _ = run(t, addr, "-o", "json", "quota", "get")
	if rows := jsonLines(t, out); code != ExitOK || len(rows) != 1 || rows[0]["tenant"] != "default" || rows[0]["used_bytes"] != 5.0 || rows[0]["used_objects"] != 1.0 ||
		rows[0]["max_bytes"] != 0.0 || rows[0]["max_objects"] != 0.0 {
		t.Fatalf("quota get -o json: exit %d, stdout %q", code, out)
	}

	epoch := c.Master().Identity.Epoch
	code, out, _ = run(t, addr, "status")
	if code != ExitOK || !strings.HasPrefix(out, fmt.Sprintf("master cli-master epoch %d leader=true\nobjects 1 (5 bytes), revision ", epoch)) ||
		!strings.Contains(out, fmt.Sprintf("agents 2, segments 2, used %d of %d bytes\n", want[holder].GetInfo().GetUsed(), 64<<20)) {
		t.Fatalf("status: exit %d, stdout %q", code, out)
	}
	code, out, _ = run(t, addr, "-o", "json", "status")
	var st struct {
		MasterID        string `json:"master_id"`
		Epoch           uint64 `json:"epoch"` // beyond float64's exact integers
		Leader          bool   `json:"leader"`
		Objects         uint64 `json:"objects"`
		Bytes           uint64 `json:"bytes"`
		AgentsConnected uint64 `json:"agents_connected"`
		Segments        uint64 `json:"segments"`
		CapacityBytes   uint64 `json:"capacity_bytes"`
	}
	if err := json.Unmarshal([]byte(out), &st); code != ExitOK || err != nil || st.MasterID != "cli-master" || st.Epoch != epoch || !st.Leader ||
		st.Objects != 1 || st.Bytes != 5 || st.AgentsConnected != 2 || st.Segments != 2 || st.CapacityBytes != 64<<20 {
		t.Fatalf("status -o json: exit %d, stdout %q (%v)", code, out, err)
	}

	// A master that is down: every command fails with exit 1.
	down := deadAddr(t)
	for _, args := range [][]string{{"segments"}, {"agents"}, {"status"}, {"quota", "get"}, {"quota", "set"}, {"ls"}, {"drain", holder}, {"drain", "--undo", holder}} {
		if code, _, _ := run(t, down, append([]string{"--timeout", "2s"}, args...)...); code != ExitError {
			t.Errorf("crescentctl %v against a stopped master: exit %d, want %d", args, code, ExitError)
		}
	}
}

// deadAddr is a loopback address nobody listens on any more.
func deadAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

// TestWatch prints the events of the real gateway: the retained batches
// replayed from --from-seq, then live ones.
func TestWatch(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{Gateway: true, AgentDisk: 8 << 20})
	addr, gw := c.MasterAddr(), c.Gateway()
	start := time.Now().UnixMilli()
	// Every kind of event, through crescentctl: stored on both media (one
	// with a group), removed, and a tenant cleared by rm --all.
	for _, step := range []struct {
		stdin string
		args  []string
	}{
		{"one", []string{"--tenant", "t", "put", "--group", "g", "k1", "-"}},
		{"zero", []string{"--tenant", "t", "put", "--medium", "disk", "k0", "-"}},
		{"", []string{"--tenant", "t", "rm", "k0"}},
		{"x", []string{"--tenant", "u", "put", "x", "-"}},
		{"", []string{"--tenant", "u", "rm", "--all"}},
	} {
		if code, _, errOut := runIn(t, addr, step.stdin, step.args...); code != ExitOK {
			t.Fatalf("crescentctl %v: exit %d, stderr %q", step.args, code, errOut)
		}
	}
	testutil.Eventually(t, 20*time.Second, func() bool { return gw.Status().PublishedEvents >= 6 }, "the gateway to publish 6 events")
	end := time.Now().UnixMilli()

	code, out, errOut := run(t, addr, "--timeout", "30s", "watch", "--gateway", gw.PubEndpoint(), "--replay", gw.ReplayEndpoint(), "--from-seq", "1", "--count", "6")
	if code != ExitOK || errOut != "" {
		t.Fatalf("watch --from-seq 1: exit %d, stderr %q, stdout\n%s", code, errOut, out)
	}
	want := []string{
		`"event_type":"stored","tenant_id":"t","backend_id":"testcluster","object_key":"k1","medium":"cpu","group_id":"g","replayed":true}`,
		`"event_type":"stored","tenant_id":"t","backend_id":"testcluster","object_key":"k0","medium":"disk","replayed":true}`,
		`"event_type":"removed","tenant_id":"t","backend_id":"testcluster","object_key":"k0","medium":"disk","replayed":true}`,
		`"event_type":"stored","tenant_id":"u","backend_id":"testcluster","object_key":"x","medium":"cpu","replayed":true}`,
		`"event_type":"removed","tenant_id":"u","backend_id":"testcluster","object_key":"x","medium":"cpu","replayed":true}`,
		`"event_type":"cleared","tenant_id":"u","backend_id":"testcluster","medium":null,"replayed":true}`,
	}
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if len(lines) != len(want) {
		t.Fatalf("watch --from-seq 1 printed %d lines, want %d:\n%s", len(lines), len(want), out)
	}
	// The gateway batches as events arrive: the sequence numbers and times
	// vary, the events and their order do not.
	prevSeq := uint64(1)
	for i, line := range lines {
		var head struct {
			Seq       uint64 `json:"seq"`
			EventID   uint64 `json:"event_id"`
			Timestamp int64  `json:"timestamp"`
		}
		if err := json.Unmarshal([]byte(line), &head); err != nil {
			t.Fatalf("line %d %q: %v", i, line, err)
		}
		prefix := fmt.Sprintf(`{"seq":%d,"event_id":%d,"timestamp":%d,`, head.Seq, i+1, head.Timestamp)
		if line != prefix+want[i] || head.Seq < prevSeq || head.Seq > uint64(i+1) || head.Timestamp < start || head.Timestamp > end {
			t.Fatalf("line %d:\n%s\nwant\n%s\n(seq from %d, time in [%d, %d])", i, line, prefix+want[i], prevSeq, start, end)
		}
		prevSeq = head.Seq
	}

	// Live: without --replay (a --gateway of its own disables the default
	// one) watch prints what is published after it subscribed. Keep
	// storing until it has seen one.
	type result struct {
		code        int
		out, errOut string
	}
	done := make(chan result, 1)
	go func() {
		code, out, errOut := run(t, addr, "--timeout", "30s", "watch", "--gateway", gw.PubEndpoint(), "--count", "1")
		done <- result{code, out, errOut}
	}()
	cl := tenantClient(t, c, "live")
	var r result
	for i, finished := 0, false; !finished; i++ {
		if err := cl.Put(t.Context(), fmt.Sprintf("live/%d", i), []byte("v")); err != nil {
			t.Fatalf("put live/%d: %v", i, err)
		}
		select {
		case r = <-done:
			finished = true
		case <-time.After(50 * time.Millisecond):
		}
	}
	var ev map[string]any
	if err := json.Unmarshal([]byte(r.out), &ev); err != nil || r.code != ExitOK || r.errOut != "" || strings.Count(r.out, "\n") != 1 ||
		ev["event_type"] != "stored" || ev["tenant_id"] != "live" || !strings.HasPrefix(ev["object_key"].(string), "live/") || ev["medium"] != "cpu" || ev["replayed"] != nil {
		t.Fatalf("live watch: exit %d, stderr %q, stdout %q", r.code, r.errOut, r.out)
	}

	if code, _, errOut := run(t, addr, "watch", "--gateway", "udp://nowhere"); code != ExitError || !strings.Contains(errOut, "subscribe udp://nowhere") {
		t.Fatalf("watch of a bad endpoint: exit %d, stderr %q", code, errOut)
	}
}

func TestBench(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{})
	addr := c.MasterAddr()
	prof := filepath.Join(t.TempDir(), "cpu.pprof")
	for _, args := range [][]string{
		{"-o", "json", "bench", "--mode", "put", "--size", "1KiB", "--concurrency", "2", "--duration", "250ms"},
		{"-o", "json", "bench", "--mode", "put", "--batch", "4", "--concurrency", "1", "--duration", "250ms", "--cpuprofile", prof},
		{"-o", "json", "bench", "--mode", "get", "--keys", "8", "--batch", "4", "--duration", "250ms"},
		{"-o", "json", "bench", "--mode", "get", "--keys", "8", "--duration", "250ms", "--alloc-get"},
		{"-o", "json", "bench", "--mode", "mixed", "--keys", "8", "--batch", "2", "--duration", "250ms", "--alloc-get", "--prefix", "mine/", "--keep"},
	} {
		code, out, errOut := run(t, addr, args...)
		rows := jsonLines(t, out)
		// mixed upserts keys that other workers read: an upsert removes
		// the old object first, so a read may miss it (as on a real master).
		mixed := args[4] == "mixed"
		if code != ExitOK || len(rows) != 1 || rows[0]["objects"].(float64) == 0 || (rows[0]["errors"] != 0.0 && !mixed) {
			t.Fatalf("crescentctl %v: exit %d, stdout %q, stderr %q", args, code, out, errOut)
		}
	}
	if st, err := os.Stat(prof); err != nil || st.Size() == 0 {
		t.Fatalf("--cpuprofile wrote nothing: %v", err)
	}
	// Without --keys, get's key space shrinks to half the cluster (two
	// agents of 32 MiB: 64 MiB, so 32 objects of 1 MiB, not 4096).
	code, out, errOut := run(t, addr, "-o", "json", "bench", "--mode", "get", "--size", "1MiB", "--duration", "250ms")
	if rows := jsonLines(t, out); code != ExitOK || len(rows) != 1 || rows[0]["errors"] != 0.0 || rows[0]["not_found"] != nil && rows[0]["not_found"] != 0.0 ||
		!strings.Contains(errOut, "--keys 32, not 4096: 32 objects of 1MiB fill half the cluster's 64MiB") {
		t.Fatalf("bench get sized to the cluster: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	// Without --keep the run's objects go; --keep left mine/.
	for _, k := range c.Keys("default") {
		if !strings.HasPrefix(k, "mine/") {
			t.Fatalf("bench left %q behind", k)
		}
	}
	code, out, _ = run(t, addr, "bench", "--duration", "200ms", "--concurrency", "1")
	if code != ExitOK || !strings.Contains(out, "mode=put size=4KiB batch=1 concurrency=1") || !strings.Contains(out, "latency per call: p50") {
		t.Fatalf("bench text: exit %d, stdout %q", code, out)
	}
	// Every call failing: exit 1 and the first error reported.
	c.SetMasterHook(func(string) error {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NO_AVAILABLE_HANDLE, "full")
	})
	defer c.SetMasterHook(nil)
	code, out, errOut = run(t, addr, "bench", "--duration", "200ms", "--concurrency", "1")
	if code != ExitError || !strings.Contains(out, "first error: put") || !strings.Contains(out, "NO_AVAILABLE_HANDLE") || !strings.Contains(errOut, "every call failed") {
		t.Fatalf("bench with every call failing: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if code, _, errOut := run(t, addr, "bench", "--mode", "get", "--keys", "2"); code != ExitError || !strings.Contains(errOut, "populate") {
		t.Fatalf("bench get whose populate fails: exit %d, stderr %q", code, errOut)
	}
	// Reads of keys the cluster no longer holds (as when --keys × --size
	// exceeds its memory): counted, and the hint names --keys.
	c.SetMasterHook(func(method string) error {
		if strings.Contains(method, "GetReplicaList") {
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "evicted")
		}
		return nil
	})
	code, out, _ = run(t, addr, "bench", "--mode", "get", "--keys", "4", "--duration", "200ms", "--concurrency", "1")
	if !strings.Contains(out, "found no object") || !strings.Contains(out, "lower --keys") {
		t.Fatalf("bench get of evicted keys: exit %d, stdout %q", code, out)
	}
}

func TestProgressAndFormatting(t *testing.T) {
	var w bytes.Buffer
	p := newProgress(&w, "put k", true)
	p.update(0, 0) // nothing to show yet
	p.update(50, 100)
	p.update(60, 100) // within 100 ms of the last draw: skipped
	p.update(100, 100)
	p.done()
	if got := w.String(); strings.Count(got, "\r") != 2 || !strings.Contains(got, "[===============               ]  50%") ||
		!strings.Contains(got, "[==============================] 100%") || !strings.HasSuffix(got, "\n") {
		t.Fatalf("progress drew %q", got)
	}
	w.Reset()
	off := newProgress(&w, "get k", false)
	off.update(1, 2)
	off.done()
	if w.Len() != 0 {
		t.Fatalf("a disabled progress bar drew %q", w.String())
	}
	if tty(&w) {
		t.Fatal("a buffer is not a terminal")
	}
	for _, tc := range []struct{ got, want string }{
		{ago(0), "never"},
		{mediumName(masterv1.Medium_MEDIUM_DISK), "disk"},
		{mediumName(masterv1.Medium_MEDIUM_UNSPECIFIED), "unknown"},
		{orDash(""), "-"},
		{orDash("x"), "x"},
	} {
		if tc.got != tc.want {
			t.Errorf("got %q, want %q", tc.got, tc.want)
		}
	}
	if m, err := parseMedium("DISK"); err != nil || m != masterv1.Medium_MEDIUM_DISK {
		t.Errorf("parseMedium(DISK) = %v, %v", m, err)
	}
	t.Setenv("CRESCENT_TENANT", "from-env")
	if got := envOr("CRESCENT_TENANT", "default"); got != "from-env" {
		t.Errorf("envOr = %q", got)
	}
}

// TestSharedMemorySocketFlag: --shm-socket (and CRESCENT_SHM_SOCKETS)
// give the command the agent's shared-memory socket: a put's bytes go
// through it (the agent's crescent_agent_shm_items_total{op="write"}
// counts them) and come back whole; a socket that is not there leaves the
// bytes on TCP.
func TestSharedMemorySocketFlag(t *testing.T) {
	dir, err := os.MkdirTemp("", "crescent-shm") // short: a Unix socket path
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	sock := filepath.Join(dir, "agent.sock")
	c := testcluster.Start(t, testcluster.Options{Agents: 1, Agent: func(_ int, cfg *agentapp.Config) { cfg.ShmSocket = sock }})
	writes := func() string {
		t.Helper()
		for line := range strings.Lines(testutil.Metrics(t, c.Agent(0).AdminAddr())) {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), `crescent_agent_shm_items_total{op="write"} `); ok {
				return v
			}
		}
		return "0"
	}
	data := bytes.Repeat([]byte("s"), 100<<10)
	file := filepath.Join(t.TempDir(), "obj")
	if err := os.WriteFile(file, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if code, _, errOut := run(t, c.MasterAddr(), "--shm-socket", filepath.Join(dir, "absent.sock"), "put", "tcp", file); code != ExitOK {
		t.Fatalf("put with an absent socket: exit %d: %s", code, errOut)
	}
	if n := writes(); n != "0" {
		t.Fatalf("%s shared-memory writes through an absent socket", n)
	}
	if code, _, errOut := run(t, c.MasterAddr(), "--shm-socket", sock, "put", "shm", file); code != ExitOK {
		t.Fatalf("put: exit %d: %s", code, errOut)
	}
	if n := writes(); n != "1" {
		t.Fatalf("crescent_agent_shm_items_total{op=\"write\"} = %s after a put with --shm-socket, want 1", n)
	}
	t.Setenv("CRESCENT_SHM_SOCKETS", sock)
	code, out, errOut := run(t, c.MasterAddr(), "get", "shm", "-o", "-")
	if code != ExitOK || out != string(data) {
		t.Fatalf("get: exit %d, %d bytes: %s", code, len(out), errOut)
	}
}
