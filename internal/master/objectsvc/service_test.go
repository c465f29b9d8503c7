package objectsvc

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

func TestPutStart(t *testing.T) {
	tests := []struct {
		name   string
		setup  func(t *testing.T, h *harness)
		req    *masterv1.PutStartRequest
		reason string
		check  func(t *testing.T, h *harness, resp *masterv1.PutStartResponse)
	}{
		{name: "one replica, default tenant and medium", req: &masterv1.PutStartRequest{Key: "k", Size: 100, ClientId: "w"},
			check: func(t *testing.T, h *harness, resp *masterv1.PutStartResponse) {
				if len(resp.Replicas) != 1 {
					t.Fatalf("replicas: got %d, want 1", len(resp.Replicas))
				}
				d := resp.Replicas[0]
				if d.Status != masterv1.ReplicaStatus_REPLICA_STATUS_PROCESSING || d.Medium != masterv1.Medium_MEDIUM_MEMORY || d.Size != 100 {
					t.Fatalf("descriptor: got %v", d)
				}
				if o, err := token.Verify(d.Token, token.Request{Mode: token.Write, SegmentID: d.SegmentId, AllocationID: d.AllocationId}, h.clk.Now(), tokenKey); err != nil || !o.Is("default", "k") {
					t.Fatalf("write token: %v (object %q/%q, want default/k)", err, o.Tenant, o.Key)
				}
			}},
		{name: "three replicas on three hosts", req: &masterv1.PutStartRequest{Key: "k", Size: 10, ClientId: "w", Config: &masterv1.ReplicateConfig{ReplicaNum: 3}},
			check: func(t *testing.T, h *harness, resp *masterv1.PutStartResponse) {
				hosts := map[string]bool{}
				for _, d := range resp.Replicas {
					hosts[d.HostId] = true
				}
				if len(hosts) != 3 {
					t.Fatalf("hosts: got %v, want 3 distinct", hosts)
				}
			}},
		{name: "preferred segment", req: &masterv1.PutStartRequest{Key: "k", Size: 10, ClientId: "w", Config: &masterv1.ReplicateConfig{PreferredSegments: []string{"seg-2-1"}}},
			check: func(t *testing.T, h *harness, resp *masterv1.PutStartResponse) {
				if got := resp.Replicas[0].SegmentId; got != "seg-2-1" {
					t.Fatalf("segment: got %s, want seg-2-1", got)
				}
			}},
		{name: "prefer local host", req: &masterv1.PutStartRequest{Key: "k", Size: 10, ClientId: "w", Config: &masterv1.ReplicateConfig{PreferLocalHost: "host-1"}},
			check: func(t *testing.T, h *harness, resp *masterv1.PutStartResponse) {
				if got := resp.Replicas[0].HostId; got != "host-1" {
					t.Fatalf("host: got %s, want host-1", got)
				}
			}},
		{name: "most free space first", setup: func(t *testing.T, h *harness) {
			for i := range 5 {
				h.put(t, "", fmt.Sprintf("fill%d", i), 100, &masterv1.ReplicateConfig{PreferredSegments: []string{"seg-0-0"}})
			}
		}, req: &masterv1.PutStartRequest{Key: "k", Size: 10, ClientId: "w", Config: &masterv1.ReplicateConfig{PreferLocalHost: "host-0"}},
			check: func(t *testing.T, h *harness, resp *masterv1.PutStartResponse) {
				if got := resp.Replicas[0].SegmentId; got != "seg-0-1" {
					t.Fatalf("segment: got %s, want the emptier seg-0-1", got)
				}
			}},
		{name: "empty key", req: &masterv1.PutStartRequest{Size: 1}, reason: "INVALID_PARAMS"},
		{name: "key too long", req: &masterv1.PutStartRequest{Key: strings.Repeat("k", 4097), Size: 1}, reason: "INVALID_PARAMS"},
		{name: "size zero", req: &masterv1.PutStartRequest{Key: "k"}, reason: "INVALID_PARAMS"},
		{name: "replica_num too large", req: &masterv1.PutStartRequest{Key: "k", Size: 1, Config: &masterv1.ReplicateConfig{ReplicaNum: 17}}, reason: "INVALID_PARAMS"},
		{name: "unknown medium", req: &masterv1.PutStartRequest{Key: "k", Size: 1, Config: &masterv1.ReplicateConfig{Medium: 9}}, reason: "INVALID_PARAMS"},
		{name: "negative soft pin ttl", req: &masterv1.PutStartRequest{Key: "k", Size: 1, Config: &masterv1.ReplicateConfig{SoftPin: true, SoftPinTtl: &durationpb.Duration{Seconds: -1}}}, reason: "INVALID_PARAMS"},
		{name: "soft pin ttl above 24h", req: &masterv1.PutStartRequest{Key: "k", Size: 1, Config: &masterv1.ReplicateConfig{SoftPin: true, SoftPinTtl: durationpb.New(25 * time.Hour)}}, reason: "INVALID_PARAMS"},
		{name: "more replicas than segments", req: &masterv1.PutStartRequest{Key: "k", Size: 1, Config: &masterv1.ReplicateConfig{ReplicaNum: 7}}, reason: "NO_AVAILABLE_HANDLE"},
		{name: "no disk segments", req: &masterv1.PutStartRequest{Key: "k", Size: 1, Config: &masterv1.ReplicateConfig{Medium: masterv1.Medium_MEDIUM_DISK}}, reason: "NO_AVAILABLE_HANDLE"},
		{name: "larger than any segment", req: &masterv1.PutStartRequest{Key: "k", Size: 1 << 20}, reason: "OBJECT_TOO_LARGE"},
		{name: "size 2^64-1", req: &masterv1.PutStartRequest{Key: "k", Size: 1<<64 - 1}, reason: "OBJECT_TOO_LARGE"},
		{name: "exists", setup: func(t *testing.T, h *harness) { h.put(t, "", "k", 10, nil) },
			req: &masterv1.PutStartRequest{Key: "k", Size: 10}, reason: "OBJECT_ALREADY_EXISTS"},
		{name: "write in progress", setup: func(t *testing.T, h *harness) {
			if _, err := h.cli.PutStart(t.Context(), &masterv1.PutStartRequest{Key: "k", Size: 10, ClientId: "a"}); err != nil {
				t.Fatal(err)
			}
		}, req: &masterv1.PutStartRequest{Key: "k", Size: 10, ClientId: "b"}, reason: "OBJECT_ALREADY_EXISTS"},
		{name: "abandoned write preempted after 30s", setup: func(t *testing.T, h *harness) {
			if _, err := h.cli.PutStart(t.Context(), &masterv1.PutStartRequest{Key: "k", Size: 10, ClientId: "a"}); err != nil {
				t.Fatal(err)
			}
			h.clk.Advance(31 * time.Second)
		}, req: &masterv1.PutStartRequest{Key: "k", Size: 10, ClientId: "b"},
			check: func(t *testing.T, h *harness, resp *masterv1.PutStartResponse) {
				_, err := h.cli.PutEnd(t.Context(), &masterv1.PutEndRequest{Key: "k", ClientId: "a"})
				wantErr(t, err, "ILLEGAL_CLIENT")
				if n := len(h.c.Agents.Live()); n != 1 {
					t.Fatalf("live allocations: got %d, want 1 (the preempted one released)", n)
				}
			}},
		{name: "tenant quota", setup: func(t *testing.T, h *harness) {
			if _, err := h.store.SetTenantQuota(t.Context(), "q", 100, 0); err != nil {
				t.Fatal(err)
			}
			h.put(t, "q", "a", 60, nil)
		}, req: &masterv1.PutStartRequest{Tenant: "q", Key: "b", Size: 50}, reason: "TENANT_QUOTA_EXCEEDED"},
		{name: "tenant object quota", setup: func(t *testing.T, h *harness) {
			if _, err := h.store.SetTenantQuota(t.Context(), "q", 0, 1); err != nil {
				t.Fatal(err)
			}
			h.put(t, "q", "a", 60, nil)
		}, req: &masterv1.PutStartRequest{Tenant: "q", Key: "b", Size: 1}, reason: "TENANT_QUOTA_EXCEEDED"},
		{name: "agent down: placed elsewhere", setup: func(t *testing.T, h *harness) { h.c.Agents.SetDown("agent-0", true) },
			req: &masterv1.PutStartRequest{Key: "k", Size: 10, Config: &masterv1.ReplicateConfig{PreferLocalHost: "host-0"}},
			check: func(t *testing.T, h *harness, resp *masterv1.PutStartResponse) {
				if got := resp.Replicas[0].HostId; got == "host-0" {
					t.Fatalf("host: got %s, want another host after agent-0 failed", got)
				}
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := start(t, 3, 2, 1000)
			if tt.setup != nil {
				tt.setup(t, h)
			}
			resp, err := h.cli.PutStart(t.Context(), tt.req)
			wantErr(t, err, tt.reason)
			if tt.check != nil {
				tt.check(t, h, resp)
			}
		})
	}
}

func TestPutEndAndRevoke(t *testing.T) {
	start1 := func(t *testing.T, h *harness) {
		if _, err := h.cli.PutStart(t.Context(), &masterv1.PutStartRequest{Key: "k", Size: 10, ClientId: "w", Config: &masterv1.ReplicateConfig{ReplicaNum: 2}}); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name   string
		setup  func(t *testing.T, h *harness)
		call   func(t *testing.T, h *harness) error
		reason string
		live   int // allocations live at the agents afterwards
		recs   []string
	}{
		{name: "end", setup: start1, live: 2, recs: []string{"stored:default/k"},
			call: func(t *testing.T, h *harness) error {
				_, err := h.cli.PutEnd(t.Context(), &masterv1.PutEndRequest{Key: "k", ClientId: "w", Checksum: 5})
				return err
			}},
		{name: "end twice is idempotent", setup: func(t *testing.T, h *harness) { h.put(t, "", "k", 10, nil) }, live: 1, recs: []string{"stored:default/k"},
			call: func(t *testing.T, h *harness) error {
				_, err := h.cli.PutEnd(t.Context(), &masterv1.PutEndRequest{Key: "k", ClientId: "w", Checksum: 310})
				return err
			}},
		{name: "end by another client", setup: start1, reason: "ILLEGAL_CLIENT", live: 2,
			call: func(t *testing.T, h *harness) error {
				_, err := h.cli.PutEnd(t.Context(), &masterv1.PutEndRequest{Key: "k", ClientId: "x"})
				return err
			}},
		{name: "end unknown", reason: "OBJECT_NOT_FOUND",
			call: func(t *testing.T, h *harness) error {
				_, err := h.cli.PutEnd(t.Context(), &masterv1.PutEndRequest{Key: "nope", ClientId: "w"})
				return err
			}},
		{name: "end with bad checksum drops the put", setup: func(t *testing.T, h *harness) { start1(t, h); h.c.Agents.BadChecksum("k") }, reason: "CHECKSUM_MISMATCH", live: 0,
			call: func(t *testing.T, h *harness) error {
				_, err := h.cli.PutEnd(t.Context(), &masterv1.PutEndRequest{Key: "k", ClientId: "w"})
				return err
			}},
		{name: "end with empty key", reason: "INVALID_PARAMS",
			call: func(t *testing.T, h *harness) error {
				_, err := h.cli.PutEnd(t.Context(), &masterv1.PutEndRequest{ClientId: "w"})
				return err
			}},
		{name: "revoke", setup: start1, live: 0,
			call: func(t *testing.T, h *harness) error {
				_, err := h.cli.PutRevoke(t.Context(), &masterv1.PutRevokeRequest{Key: "k", ClientId: "w"})
				return err
			}},
		{name: "revoke by another client", setup: start1, reason: "ILLEGAL_CLIENT", live: 2,
			call: func(t *testing.T, h *harness) error {
				_, err := h.cli.PutRevoke(t.Context(), &masterv1.PutRevokeRequest{Key: "k", ClientId: "x"})
				return err
			}},
		{name: "revoke a completed object", setup: func(t *testing.T, h *harness) { h.put(t, "", "k", 10, nil) }, reason: "PUT_EXPIRED", live: 1, recs: []string{"stored:default/k"},
			call: func(t *testing.T, h *harness) error {
				_, err := h.cli.PutRevoke(t.Context(), &masterv1.PutRevokeRequest{Key: "k", ClientId: "w"})
				return err
			}},
		{name: "revoke unknown", reason: "OBJECT_NOT_FOUND",
			call: func(t *testing.T, h *harness) error {
				_, err := h.cli.PutRevoke(t.Context(), &masterv1.PutRevokeRequest{Key: "k", ClientId: "w"})
				return err
			}},
		{name: "revoke of an upsert removes the old object too", setup: func(t *testing.T, h *harness) {
			h.put(t, "", "k", 10, nil)
			if _, err := h.cli.PutStart(t.Context(), &masterv1.PutStartRequest{Key: "k", Size: 20, ClientId: "w", Upsert: true}); err != nil {
				t.Fatal(err)
			}
		}, live: 0, recs: []string{"stored:default/k", "removed:default/k"},
			call: func(t *testing.T, h *harness) error {
				_, err := h.cli.PutRevoke(t.Context(), &masterv1.PutRevokeRequest{Key: "k", ClientId: "w"})
				return err
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := start(t, 3, 2, 1000)
			if tt.setup != nil {
				tt.setup(t, h)
			}
			wantErr(t, tt.call(t, h), tt.reason)
			if got := len(h.c.Agents.Live()); got != tt.live {
				t.Fatalf("live allocations: got %d, want %d", got, tt.live)
			}
			if got := h.changes(t); !slices.Equal(got, tt.recs) {
				t.Fatalf("changes: got %v, want %v", got, tt.recs)
			}
			if p := h.c.Agents.Problems(); len(p) > 0 {
				t.Fatalf("agent problems: %v", p)
			}
		})
	}
}

func TestUpsertOrdersRemovedBeforeStored(t *testing.T) {
	h := start(t, 2, 1, 1000)
	h.put(t, "t", "k", 10, nil)
	if _, err := h.cli.PutStart(t.Context(), &masterv1.PutStartRequest{Tenant: "t", Key: "k", Size: 30, ClientId: "w", Upsert: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.cli.PutEnd(t.Context(), &masterv1.PutEndRequest{Tenant: "t", Key: "k", ClientId: "w", Checksum: 2}); err != nil {
		t.Fatal(err)
	}
	want := []string{"stored:t/k", "removed:t/k", "stored:t/k"}
	if got := h.changes(t); !slices.Equal(got, want) {
		t.Fatalf("changes: got %v, want %v", got, want)
	}
	resp, err := h.cli.GetSize(t.Context(), &masterv1.GetSizeRequest{Tenant: "t", Key: "k"})
	if err != nil || resp.Size != 30 {
		t.Fatalf("size: got %v, %v; want 30", resp, err)
	}
	q, _ := h.store.TenantQuota(t.Context(), "t")
	if q.UsedBytes != 30 || q.UsedObjects != 1 {
		t.Fatalf("quota usage: got %d bytes %d objects, want 30, 1", q.UsedBytes, q.UsedObjects)
	}
	if n := len(h.c.Agents.Live()); n != 1 {
		t.Fatalf("live allocations: got %d, want 1", n)
	}
}

func TestGetReplicaList(t *testing.T) {
	tests := []struct {
		name   string
		setup  func(t *testing.T, h *harness)
		req    *masterv1.GetReplicaListRequest
		reason string
		check  func(t *testing.T, h *harness, resp *masterv1.GetReplicaListResponse)
	}{
		{name: "readable, local replica first", setup: func(t *testing.T, h *harness) {
			h.put(t, "", "k", 10, &masterv1.ReplicateConfig{ReplicaNum: 3, GroupId: "g"})
		}, req: &masterv1.GetReplicaListRequest{Key: "k", ClientHost: "host-2"},
			check: func(t *testing.T, h *harness, resp *masterv1.GetReplicaListResponse) {
				if len(resp.Replicas) != 3 || resp.Replicas[0].HostId != "host-2" {
					t.Fatalf("replicas: got %v, want 3 with host-2 first", resp.Replicas)
				}
				if resp.Checksum != 310 || resp.Size != 10 || resp.GroupId != "g" || resp.LeaseTtl.AsDuration() != 10*time.Second {
					t.Fatalf("response: got %v", resp)
				}
				for _, d := range resp.Replicas {
					if o, err := token.Verify(d.Token, token.Request{Mode: token.Read, SegmentID: d.SegmentId, AllocationID: d.AllocationId}, h.clk.Now(), tokenKey); err != nil || !o.Is("default", "k") {
						t.Fatalf("read token: %v (object %q/%q, want default/k)", err, o.Tenant, o.Key)
					}
					if d.TokenExpiryUnixMs != h.clk.Now().Add(10*time.Second).UnixMilli() {
						t.Fatalf("token expiry: got %d, want lease end", d.TokenExpiryUnixMs)
					}
				}
			}},
		{name: "suspected segment is skipped", setup: func(t *testing.T, h *harness) {
			h.put(t, "", "k", 10, &masterv1.ReplicateConfig{ReplicaNum: 2, PreferredSegments: []string{"seg-0-0", "seg-1-0"}})
			h.c.Reg.SetHealth("seg-0-0", masterv1.SegmentHealth_SEGMENT_HEALTH_SUSPECTED)
		}, req: &masterv1.GetReplicaListRequest{Key: "k"},
			check: func(t *testing.T, h *harness, resp *masterv1.GetReplicaListResponse) {
				if len(resp.Replicas) != 1 || resp.Replicas[0].SegmentId != "seg-1-0" {
					t.Fatalf("replicas: got %v, want only seg-1-0", resp.Replicas)
				}
				if got := h.changes(t); len(got) != 1 {
					t.Fatalf("changes: got %v, want only the stored record (health emits nothing)", got)
				}
			}},
		{name: "every replica suspected", setup: func(t *testing.T, h *harness) {
			h.put(t, "", "k", 10, &masterv1.ReplicateConfig{PreferredSegments: []string{"seg-0-0"}})
			h.c.Reg.SetHealth("seg-0-0", masterv1.SegmentHealth_SEGMENT_HEALTH_SUSPECTED)
		}, req: &masterv1.GetReplicaListRequest{Key: "k"}, reason: "REPLICA_IS_NOT_READY"},
		{name: "only processing", setup: func(t *testing.T, h *harness) {
			if _, err := h.cli.PutStart(t.Context(), &masterv1.PutStartRequest{Key: "k", Size: 10, ClientId: "w"}); err != nil {
				t.Fatal(err)
			}
		}, req: &masterv1.GetReplicaListRequest{Key: "k"}, reason: "REPLICA_IS_NOT_READY"},
		{name: "not found", req: &masterv1.GetReplicaListRequest{Key: "k"}, reason: "OBJECT_NOT_FOUND"},
		{name: "unknown tenant", req: &masterv1.GetReplicaListRequest{Tenant: "zz", Key: "k"}, reason: "OBJECT_NOT_FOUND"},
		{name: "empty key", req: &masterv1.GetReplicaListRequest{}, reason: "INVALID_PARAMS"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := start(t, 3, 2, 1000)
			if tt.setup != nil {
				tt.setup(t, h)
			}
			resp, err := h.cli.GetReplicaList(t.Context(), tt.req)
			wantErr(t, err, tt.reason)
			if tt.check != nil {
				tt.check(t, h, resp)
			}
		})
	}
}

func TestExistSizeRouteList(t *testing.T) {
	h := start(t, 2, 1, 1000)
	ctx := t.Context()
	h.put(t, "", "a1", 10, &masterv1.ReplicateConfig{ReplicaNum: 2})
	h.put(t, "", "a2", 20, &masterv1.ReplicateConfig{HardPin: true})
	h.put(t, "", "b1", 30, nil)
	if _, err := h.cli.PutStart(ctx, &masterv1.PutStartRequest{Key: "p", Size: 5, ClientId: "w"}); err != nil {
		t.Fatal(err)
	}
	exist := []struct {
		key  string
		want bool
	}{{"a1", true}, {"p", false}, {"zz", false}}
	for _, e := range exist {
		resp, err := h.cli.Exist(ctx, &masterv1.ExistRequest{Key: e.key})
		if err != nil || resp.Exists != e.want {
			t.Fatalf("Exist(%s): got %v, %v; want %v", e.key, resp.GetExists(), err, e.want)
		}
	}
	// Exist granted a lease on a1.
	_, err := h.cli.Remove(ctx, &masterv1.RemoveRequest{Key: "a1"})
	wantErr(t, err, "OBJECT_HAS_LEASE")
	_, err = h.cli.Exist(ctx, &masterv1.ExistRequest{})
	wantErr(t, err, "INVALID_PARAMS")

	sizes := []struct {
		key    string
		size   uint64
		reason string
	}{{"b1", 30, ""}, {"p", 0, "REPLICA_IS_NOT_READY"}, {"zz", 0, "OBJECT_NOT_FOUND"}}
	for _, s := range sizes {
		resp, err := h.cli.GetSize(ctx, &masterv1.GetSizeRequest{Key: s.key})
		wantErr(t, err, s.reason)
		if resp.GetSize() != s.size {
			t.Fatalf("GetSize(%s): got %d, want %d", s.key, resp.GetSize(), s.size)
		}
	}
	route, err := h.cli.QueryRoute(ctx, &masterv1.QueryRouteRequest{Key: "p"})
	if err != nil || len(route.Replicas) != 1 || route.Replicas[0].Status != masterv1.ReplicaStatus_REPLICA_STATUS_PROCESSING || len(route.Replicas[0].Token) != 0 {
		t.Fatalf("QueryRoute(p): got %v, %v; want one PROCESSING replica without token", route, err)
	}
	_, err = h.cli.QueryRoute(ctx, &masterv1.QueryRouteRequest{Key: "zz"})
	wantErr(t, err, "OBJECT_NOT_FOUND")

	var keys []string
	tok := ""
	for {
		resp, err := h.cli.ListObjects(ctx, &masterv1.ListObjectsRequest{PageSize: 2, PageToken: tok})
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range resp.Objects {
			keys = append(keys, o.Key)
			if o.Key == "a2" && !o.HardPinned {
				t.Fatalf("a2: got %v, want hard-pinned", o)
			}
			if o.Key == "p" && !o.Processing {
				t.Fatalf("p: got %v, want processing", o)
			}
		}
		if tok = resp.NextPageToken; tok == "" {
			break
		}
	}
	if want := []string{"a1", "a2", "b1", "p"}; !slices.Equal(keys, want) {
		t.Fatalf("listed keys: got %v, want %v", keys, want)
	}
	resp, err := h.cli.ListObjects(ctx, &masterv1.ListObjectsRequest{Prefix: "a"})
	if err != nil || len(resp.Objects) != 2 {
		t.Fatalf("prefix list: got %v, %v; want 2", resp, err)
	}
	_, err = h.cli.ListObjects(ctx, &masterv1.ListObjectsRequest{PageToken: "!!"})
	wantErr(t, err, "INVALID_PARAMS")
}

func TestRemove(t *testing.T) {
	tests := []struct {
		name   string
		setup  func(t *testing.T, h *harness)
		req    *masterv1.RemoveRequest
		reason string
		recs   []string
	}{
		{name: "remove", setup: func(t *testing.T, h *harness) { h.put(t, "", "k", 10, nil) },
			req: &masterv1.RemoveRequest{Key: "k"}, recs: []string{"stored:default/k", "removed:default/k"}},
		{name: "leased", setup: func(t *testing.T, h *harness) {
			h.put(t, "", "k", 10, nil)
			if _, err := h.cli.GetReplicaList(t.Context(), &masterv1.GetReplicaListRequest{Key: "k"}); err != nil {
				t.Fatal(err)
			}
		}, req: &masterv1.RemoveRequest{Key: "k"}, reason: "OBJECT_HAS_LEASE", recs: []string{"stored:default/k"}},
		{name: "leased, forced", setup: func(t *testing.T, h *harness) {
			h.put(t, "", "k", 10, nil)
			if _, err := h.cli.GetReplicaList(t.Context(), &masterv1.GetReplicaListRequest{Key: "k"}); err != nil {
				t.Fatal(err)
			}
		}, req: &masterv1.RemoveRequest{Key: "k", Force: true}, recs: []string{"stored:default/k", "removed:default/k"}},
		{name: "lease expired", setup: func(t *testing.T, h *harness) {
			h.put(t, "", "k", 10, nil)
			if _, err := h.cli.GetReplicaList(t.Context(), &masterv1.GetReplicaListRequest{Key: "k"}); err != nil {
				t.Fatal(err)
			}
			h.clk.Advance(11 * time.Second)
		}, req: &masterv1.RemoveRequest{Key: "k"}, recs: []string{"stored:default/k", "removed:default/k"}},
		{name: "hard pinned", setup: func(t *testing.T, h *harness) { h.put(t, "", "k", 10, &masterv1.ReplicateConfig{HardPin: true}) },
			req: &masterv1.RemoveRequest{Key: "k"}, reason: "OBJECT_BUSY", recs: []string{"stored:default/k"}},
		{name: "hard pinned, forced", setup: func(t *testing.T, h *harness) { h.put(t, "", "k", 10, &masterv1.ReplicateConfig{HardPin: true}) },
			req: &masterv1.RemoveRequest{Key: "k", Force: true}, recs: []string{"stored:default/k", "removed:default/k"}},
		{name: "write in progress, even forced", setup: func(t *testing.T, h *harness) {
			if _, err := h.cli.PutStart(t.Context(), &masterv1.PutStartRequest{Key: "k", Size: 10, ClientId: "w"}); err != nil {
				t.Fatal(err)
			}
		}, req: &masterv1.RemoveRequest{Key: "k", Force: true}, reason: "OBJECT_BUSY"},
		{name: "not found", req: &masterv1.RemoveRequest{Key: "k"}, reason: "OBJECT_NOT_FOUND"},
		{name: "key too long", req: &masterv1.RemoveRequest{Key: strings.Repeat("x", 5000)}, reason: "INVALID_PARAMS"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := start(t, 2, 1, 1000)
			if tt.setup != nil {
				tt.setup(t, h)
			}
			_, err := h.cli.Remove(t.Context(), tt.req)
			wantErr(t, err, tt.reason)
			if got := h.changes(t); !slices.Equal(got, tt.recs) {
				t.Fatalf("changes: got %v, want %v", got, tt.recs)
			}
		})
	}
}

func TestBulkRemove(t *testing.T) {
	fill := func(t *testing.T, h *harness) {
		for _, k := range []string{"a1", "a2", "b1"} {
			h.put(t, "t", k, 10, nil)
		}
		h.put(t, "other", "a1", 10, nil)
	}
	lease := func(key string) func(t *testing.T, h *harness) {
		return func(t *testing.T, h *harness) {
			if _, err := h.cli.GetReplicaList(t.Context(), &masterv1.GetReplicaListRequest{Tenant: "t", Key: key}); err != nil {
				t.Fatal(err)
			}
		}
	}
	tests := []struct {
		name                   string
		extra                  func(t *testing.T, h *harness)
		call                   func(t *testing.T, h *harness) (uint64, uint64, error)
		removed, skipped       uint64
		reason                 string
		cleared, otherSurvives bool
	}{
		{name: "remove all empties the tenant", cleared: true, removed: 3, otherSurvives: true,
			call: func(t *testing.T, h *harness) (uint64, uint64, error) {
				r, err := h.cli.RemoveAll(t.Context(), &masterv1.RemoveAllRequest{Tenant: "t"})
				return r.GetRemoved(), r.GetSkipped(), err
			}},
		{name: "remove all skips a leased object: no cleared", extra: lease("a2"), removed: 2, skipped: 1, otherSurvives: true,
			call: func(t *testing.T, h *harness) (uint64, uint64, error) {
				r, err := h.cli.RemoveAll(t.Context(), &masterv1.RemoveAllRequest{Tenant: "t"})
				return r.GetRemoved(), r.GetSkipped(), err
			}},
		{name: "remove all forced", extra: lease("a2"), removed: 3, cleared: true, otherSurvives: true,
			call: func(t *testing.T, h *harness) (uint64, uint64, error) {
				r, err := h.cli.RemoveAll(t.Context(), &masterv1.RemoveAllRequest{Tenant: "t", Force: true})
				return r.GetRemoved(), r.GetSkipped(), err
			}},
		{name: "remove all of an empty tenant records nothing", otherSurvives: true,
			call: func(t *testing.T, h *harness) (uint64, uint64, error) {
				r, err := h.cli.RemoveAll(t.Context(), &masterv1.RemoveAllRequest{Tenant: "nobody"})
				return r.GetRemoved(), r.GetSkipped(), err
			}},
		{name: "by prefix", removed: 2, otherSurvives: true,
			call: func(t *testing.T, h *harness) (uint64, uint64, error) {
				r, err := h.cli.RemoveByPrefix(t.Context(), &masterv1.RemoveByPrefixRequest{Tenant: "t", Prefix: "a"})
				return r.GetRemoved(), r.GetSkipped(), err
			}},
		{name: "by prefix, empty prefix", reason: "INVALID_PARAMS", otherSurvives: true,
			call: func(t *testing.T, h *harness) (uint64, uint64, error) {
				r, err := h.cli.RemoveByPrefix(t.Context(), &masterv1.RemoveByPrefixRequest{Tenant: "t"})
				return r.GetRemoved(), r.GetSkipped(), err
			}},
		{name: "by regex", extra: lease("b1"), removed: 1, skipped: 1, otherSurvives: true,
			call: func(t *testing.T, h *harness) (uint64, uint64, error) {
				r, err := h.cli.RemoveByRegex(t.Context(), &masterv1.RemoveByRegexRequest{Tenant: "t", Regex: "^(a1|b1)$"})
				return r.GetRemoved(), r.GetSkipped(), err
			}},
		{name: "by regex, bad regex", reason: "INVALID_PARAMS", otherSurvives: true,
			call: func(t *testing.T, h *harness) (uint64, uint64, error) {
				r, err := h.cli.RemoveByRegex(t.Context(), &masterv1.RemoveByRegexRequest{Tenant: "t", Regex: "a("})
				return r.GetRemoved(), r.GetSkipped(), err
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := start(t, 2, 1, 1000)
			fill(t, h)
			if tt.extra != nil {
				tt.extra(t, h)
			}
			removed, skipped, err := tt.call(t, h)
			wantErr(t, err, tt.reason)
			if removed != tt.removed || skipped != tt.skipped {
				t.Fatalf("counts: got removed %d skipped %d, want %d, %d", removed, skipped, tt.removed, tt.skipped)
			}
			recs := h.changes(t)
			if got := slices.Contains(recs, "cleared:t/"); got != tt.cleared {
				t.Fatalf("cleared recorded: got %v, want %v (%v)", got, tt.cleared, recs)
			}
			removedRecs := 0
			for _, r := range recs {
				if strings.HasPrefix(r, "removed:") {
					removedRecs++
				}
			}
			if removedRecs != int(tt.removed) {
				t.Fatalf("removed records: got %d, want %d (%v)", removedRecs, tt.removed, recs)
			}
			if _, err := h.cli.GetSize(t.Context(), &masterv1.GetSizeRequest{Tenant: "other", Key: "a1"}); (err == nil) != tt.otherSurvives {
				t.Fatalf("other tenant's object: err %v", err)
			}
		})
	}
}

func TestBatches(t *testing.T) {
	h := start(t, 3, 2, 1000)
	ctx := t.Context()
	h.put(t, "", "exists", 10, nil)

	// Envelope errors fail the whole call.
	_, err := h.cli.BatchPutStart(ctx, &masterv1.BatchPutStartRequest{})
	wantErr(t, err, "INVALID_PARAMS")
	big := make([]*masterv1.GetReplicaListRequest, 257)
	for i := range big {
		big[i] = &masterv1.GetReplicaListRequest{Key: "k"}
	}
	_, err = h.cli.BatchGetReplicaList(ctx, &masterv1.BatchGetReplicaListRequest{Items: big})
	wantErr(t, err, "INVALID_PARAMS")

	starts, err := h.cli.BatchPutStart(ctx, &masterv1.BatchPutStartRequest{Items: []*masterv1.PutStartRequest{
		{Key: "b1", Size: 10, ClientId: "w"},
		{Key: "exists", Size: 10, ClientId: "w"},
		{Key: "", Size: 10, ClientId: "w"},
		{Key: "b2", Size: 10, ClientId: "w", Config: &masterv1.ReplicateConfig{ReplicaNum: 2}},
		{Key: "b3", Size: 10, ClientId: "w"},
		{Key: "b4", Size: 10, ClientId: "w", Config: &masterv1.ReplicateConfig{ReplicaNum: 99}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{"", "OBJECT_ALREADY_EXISTS", "INVALID_PARAMS", "", "", "INVALID_PARAMS"} {
		wantItem(t, starts.Results[i].Status, want)
	}
	if n := len(starts.Results[3].Replicas); n != 2 {
		t.Fatalf("b2 replicas: got %d, want 2", n)
	}
	reserves, _, _ := h.c.Agents.Calls()
	if reserves > 1+3 { // the put of "exists" plus at most one per agent
		t.Fatalf("Reserve calls: got %d, want at most one per agent for the batch", reserves)
	}
	ends, err := h.cli.BatchPutEnd(ctx, &masterv1.BatchPutEndRequest{Items: []*masterv1.PutEndRequest{
		{Key: "b1", ClientId: "w", Checksum: 1},
		{Key: "b2", ClientId: "x", Checksum: 1},
		{Key: "b2", ClientId: "w", Checksum: 1},
		{Key: "nope", ClientId: "w"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{"", "ILLEGAL_CLIENT", "", "OBJECT_NOT_FOUND"} {
		wantItem(t, ends.Results[i], want)
	}
	revokes, err := h.cli.BatchPutRevoke(ctx, &masterv1.BatchPutRevokeRequest{Items: []*masterv1.PutRevokeRequest{
		{Key: "b3", ClientId: "w"}, {Key: "b1", ClientId: "w"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	wantItem(t, revokes.Results[0], "")
	wantItem(t, revokes.Results[1], "PUT_EXPIRED")

	gets, err := h.cli.BatchGetReplicaList(ctx, &masterv1.BatchGetReplicaListRequest{Items: []*masterv1.GetReplicaListRequest{
		{Key: "b1"}, {Key: "b3"}, {Key: "b2"}, {Key: ""},
	}})
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{"", "OBJECT_NOT_FOUND", "", "INVALID_PARAMS"} {
		wantItem(t, gets.Results[i].Status, want)
	}
	if n := len(gets.Results[2].ReplicaList.GetReplicas()); n != 2 {
		t.Fatalf("b2 replicas: got %d, want 2", n)
	}
	ex, err := h.cli.BatchExist(ctx, &masterv1.BatchExistRequest{Items: []*masterv1.ExistRequest{{Key: "b1"}, {Key: "b3"}, {Key: "exists"}}})
	if err != nil || !slices.Equal(ex.Exists, []bool{true, false, true}) {
		t.Fatalf("BatchExist: got %v, %v", ex.GetExists(), err)
	}
	rm, err := h.cli.BatchRemove(ctx, &masterv1.BatchRemoveRequest{Items: []*masterv1.RemoveRequest{
		{Key: "b1"}, {Key: "b1", Force: true}, {Key: "b3"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{"OBJECT_HAS_LEASE", "", "OBJECT_NOT_FOUND"} {
		wantItem(t, rm.Results[i], want)
	}
	if p := h.c.Agents.Problems(); len(p) > 0 {
		t.Fatalf("agent problems: %v", p)
	}
}

func TestErrorsCarryCodes(t *testing.T) {
	h := start(t, 1, 1, 1000)
	_, err := h.cli.GetReplicaList(t.Context(), &masterv1.GetReplicaListRequest{Key: "k"})
	if got := status.Code(err); got != codes.NotFound {
		t.Fatalf("code: got %v, want NotFound", got)
	}
	_, err = h.cli.PutStart(t.Context(), &masterv1.PutStartRequest{Key: "k", Size: 1 << 30})
	if got := status.Code(err); got != codes.InvalidArgument {
		t.Fatalf("code: got %v, want InvalidArgument (OBJECT_TOO_LARGE)", got)
	}
	_, err = h.cli.PutStart(t.Context(), &masterv1.PutStartRequest{Key: "k", Size: 1000, Config: &masterv1.ReplicateConfig{ReplicaNum: 2}})
	if got := status.Code(err); got != codes.ResourceExhausted {
		t.Fatalf("code: got %v, want ResourceExhausted", got)
	}
}
