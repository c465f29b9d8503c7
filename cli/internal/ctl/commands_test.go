package ctl

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// crescentctl's commands through Main (cobra root, flags, exit codes,
// stdout and stderr) against the shared fake cluster.

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
	for _, grpcData := range []bool{false, true} {
		t.Run(map[bool]string{false: "transfer", true: "grpc-data"}[grpcData], func(t *testing.T) {
			f := newFake(t, testutil.FakeConfig{Transfer: true})
			addr := f.Addr()
			var global []string
			if grpcData {
				global = []string{"--grpc-data"}
			}
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
			if got, _ := f.Object("default", "big"); !bytes.Equal(got, data) {
				t.Fatalf("the fake holds %d bytes, want %d", len(got), len(data))
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

			code, out, _ = run(t, addr, append(global, "stat", "big")...)
			for _, want := range []string{"key:      big\n", "size:     655360\n", "media:    cpu\n", "group:    g7\n", "replica 1: COMPLETE on host-0", "replica 2: COMPLETE on host-1"} {
				if code != ExitOK || !strings.Contains(out, want) {
					t.Fatalf("stat: exit %d, stdout %q, want %q in it", code, out, want)
				}
			}
			code, out, _ = run(t, addr, append(global, "-o", "json", "stat", "big")...)
			rows := jsonLines(t, out)
			if code != ExitOK || len(rows) != 1 || rows[0]["group_id"] != "g7" || len(rows[0]["replicas"].([]any)) != 2 {
				t.Fatalf("stat -o json: exit %d, stdout %q", code, out)
			}
			if code, _, _ := run(t, addr, append(global, "stat", "missing")...); code != ExitNotFound {
				t.Fatalf("stat missing: exit %d, want %d", code, ExitNotFound)
			}
		})
	}
}

func TestUsageErrors(t *testing.T) {
	f := newFake(t, testutil.FakeConfig{})
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
		if code, _, errOut := run(t, f.Addr(), args...); code != ExitUsage || !strings.HasPrefix(errOut, "crescentctl: ") {
			t.Errorf("crescentctl %v: exit %d, stderr %q; want %d", args, code, errOut, ExitUsage)
		}
	}
	if code, _, _ := run(t, f.Addr(), "put", "k", filepath.Join(dir, "missing")); code != ExitError {
		t.Errorf("put of a missing file: exit %d, want %d", code, ExitError)
	}
}

func TestRemoveAndList(t *testing.T) {
	clk := testutil.NewClock(time.Unix(1000, 0))
	f := newFake(t, testutil.FakeConfig{Now: clk.Now})
	addr := f.Addr()
	seed(t, f,
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
	if keys := f.Keys("default"); len(keys) != 0 {
		t.Fatalf("left %v", keys)
	}
	if code, _, _ := run(t, addr, "rm", "--regex", "("); code != ExitError {
		t.Fatalf("rm --regex of a bad regex: exit %d", code)
	}
}

func TestAdminCommands(t *testing.T) {
	f := newFake(t, testutil.FakeConfig{Transfer: true})
	addr := f.Addr()
	seed(t, f, client.Item{Key: "k", Data: []byte("hello")})

	code, out, _ := run(t, addr, "segments")
	if code != ExitOK || !strings.HasPrefix(out, "SEGMENT") || !strings.Contains(out, "seg-0") || !strings.Contains(out, "HEALTHY") {
		t.Fatalf("segments: exit %d, stdout %q", code, out)
	}
	code, out, _ = run(t, addr, "-o", "json", "segments")
	rows := jsonLines(t, out)
	if code != ExitOK || len(rows) != 2 || rows[0]["lifecycle"] != "OK" || rows[0]["used"] != 5.0 || rows[0]["can_allocate"] != true {
		t.Fatalf("segments -o json: exit %d, stdout %q", code, out)
	}

	code, out, _ = run(t, addr, "agents")
	if code != ExitOK || !strings.HasPrefix(out, "AGENT") || !strings.Contains(out, "agent-1") || !strings.Contains(out, f.Agent(1).TransferAddr()) {
		t.Fatalf("agents: exit %d, stdout %q", code, out)
	}
	code, out, _ = run(t, addr, "-o", "json", "agents")
	rows = jsonLines(t, out)
	if code != ExitOK || len(rows) != 2 || rows[1]["endpoint"] != f.Agent(1).Addr() || rows[1]["connected"] != true {
		t.Fatalf("agents -o json: exit %d, stdout %q", code, out)
	}

	code, out, _ = run(t, addr, "--tenant", "t9", "quota", "set", "--max-bytes", "1000", "--max-objects", "3")
	if code != ExitOK || out != "tenant t9: bytes 0/1000 objects 0/3 (0 = unlimited)\n" {
		t.Fatalf("quota set: exit %d, stdout %q", code, out)
	}
	code, out, _ = run(t, addr, "-o", "json", "quota", "get")
	if rows := jsonLines(t, out); code != ExitOK || rows[0]["tenant"] != "default" || rows[0]["used_bytes"] != 5.0 || rows[0]["used_objects"] != 1.0 {
		t.Fatalf("quota get -o json: exit %d, stdout %q", code, out)
	}

	code, out, _ = run(t, addr, "status")
	if code != ExitOK || !strings.Contains(out, "master fake-master epoch 1 leader=true\nobjects 1 (5 bytes)") || !strings.Contains(out, "agents 2, segments 2") {
		t.Fatalf("status: exit %d, stdout %q", code, out)
	}
	code, out, _ = run(t, addr, "-o", "json", "status")
	if rows := jsonLines(t, out); code != ExitOK || rows[0]["objects"] != 1.0 || rows[0]["agents_connected"] != 2.0 {
		t.Fatalf("status -o json: exit %d, stdout %q", code, out)
	}

	// A master that is down: every command fails with exit 1.
	f.Close()
	for _, args := range [][]string{{"segments"}, {"agents"}, {"status"}, {"quota", "get"}, {"quota", "set"}, {"ls"}, {"drain", "seg-0"}, {"drain", "--undo", "seg-0"}} {
		if code, _, _ := run(t, addr, append([]string{"--timeout", "2s"}, args...)...); code != ExitError {
			t.Errorf("crescentctl %v against a stopped master: exit %d, want %d", args, code, ExitError)
		}
	}
}

func TestWatch(t *testing.T) {
	pub, err := testutil.StartPublisher()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pub.Close)
	enc := kvevent.NewEncoder(kvevent.EncoderOptions{Envelope: kvevent.Envelope{BackendID: "gw-1"}, ObjectKey: true})
	payload, err := enc.AppendBatch(nil, 1700000000000, []kvevent.Event{
		{ID: 1, Type: kvevent.Stored, Tenant: "t", Key: "k1", Medium: kvevent.MediumCPU, GroupID: "g"},
		{ID: 2, Type: kvevent.Removed, Tenant: "t", Key: "k0", Medium: kvevent.MediumDisk},
		{ID: 3, Type: kvevent.Cleared, Tenant: "u"},
	})
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		code        int
		out, errOut string
	}
	done := make(chan result, 1)
	go func() {
		code, out, errOut := run(t, "127.0.0.1:1", "--timeout", "30s", "watch", "--gateway", pub.Endpoint(), "--count", "3")
		done <- result{code, out, errOut}
	}()
	if err := pub.WaitSubscriber(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := pub.Send(nil, kvevent.PutSeq(1), payload); err != nil {
		t.Fatal(err)
	}
	r := <-done
	want := `{"seq":1,"event_id":1,"timestamp":1700000000000,"event_type":"stored","tenant_id":"t","backend_id":"gw-1","object_key":"k1","medium":"cpu","group_id":"g"}
{"seq":1,"event_id":2,"timestamp":1700000000000,"event_type":"removed","tenant_id":"t","backend_id":"gw-1","object_key":"k0","medium":"disk"}
{"seq":1,"event_id":3,"timestamp":1700000000000,"event_type":"cleared","tenant_id":"u","backend_id":"gw-1","medium":null}
`
	if r.code != ExitOK || r.out != want {
		t.Fatalf("watch: exit %d, stderr %q, stdout\n%s\nwant\n%s", r.code, r.errOut, r.out, want)
	}
	if code, _, errOut := run(t, "127.0.0.1:1", "watch", "--gateway", "udp://nowhere"); code != ExitError || !strings.Contains(errOut, "subscribe udp://nowhere") {
		t.Fatalf("watch of a bad endpoint: exit %d, stderr %q", code, errOut)
	}
}

func TestBench(t *testing.T) {
	f := newFake(t, testutil.FakeConfig{Transfer: true})
	addr := f.Addr()
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
	// Without --keep the run's objects go; --keep left mine/.
	for _, k := range f.Keys("default") {
		if !strings.HasPrefix(k, "mine/") {
			t.Fatalf("bench left %q behind", k)
		}
	}
	code, out, _ := run(t, addr, "bench", "--duration", "200ms", "--concurrency", "1")
	if code != ExitOK || !strings.Contains(out, "mode=put size=4KiB batch=1 concurrency=1") || !strings.Contains(out, "latency per call: p50") {
		t.Fatalf("bench text: exit %d, stdout %q", code, out)
	}
	// Every call failing: exit 1 and the first error reported.
	f.SetHook(func(string) error {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NO_AVAILABLE_HANDLE, "full")
	})
	code, out, errOut := run(t, addr, "bench", "--duration", "200ms", "--concurrency", "1")
	if code != ExitError || !strings.Contains(out, "first error: put") || !strings.Contains(errOut, "every call failed") {
		t.Fatalf("bench with every call failing: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	f.SetHook(func(string) error {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NO_AVAILABLE_HANDLE, "full")
	})
	if code, _, errOut := run(t, addr, "bench", "--mode", "get", "--keys", "2"); code != ExitError || !strings.Contains(errOut, "populate") {
		t.Fatalf("bench get whose populate fails: exit %d, stderr %q", code, errOut)
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
