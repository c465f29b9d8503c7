package client_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	agentapp "github.com/crescent-kv/crescent/internal/agent/app"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/pkg/client"
)

// onlyWriter hides every method of its writer but Write (a bytes.Buffer
// GetTo cannot rewind).
type onlyWriter struct{ io.Writer }

// TestGetToRewinds: the first replica GetTo reads (the one on host-0, the
// client's host) streams bytes that fail the object checksum, which GetTo
// learns only at the end, after they reached w. Into a writer it can
// rewind (a regular file, from a non-zero offset) GetTo truncates it back,
// restarts progress from 0 and reads the next replica: the file holds
// exactly what it held plus the object. Into one it cannot (no Seek; a
// pipe, whose Seek fails) it stops with CHECKSUM_MISMATCH, as before.
// With every replica corrupt, the file is rewound and the error names
// each replica.
//
// Both media: a memory segment corrupted in place (testcluster.Corrupt),
// and a disk segment corrupted in its data file, as in the field. Every
// case reads its own object, corrupted just before, exactly once: an
// agent may drop a disk allocation whose bytes failed their checksum as
// it served them (internal/agent/segment/lost.go), so a second read of the
// same object could be refused before its first byte (or find the replica
// gone) and not test the rewind. The first read of a corrupt replica is
// streamed whole either way (the agent cannot take back a length it
// promised; memory segments are not checked at all), so each case's
// outcome is the same with or without that agent check.
func TestGetToRewinds(t *testing.T) {
	var diskDirs [2]string
	h := start(t, testcluster.Options{AgentDisk: 32 << 20, Agent: func(i int, c *agentapp.Config) { diskDirs[i] = c.DiskDir }})
	media := []struct {
		name    string
		medium  masterv1.Medium
		corrupt func(t *testing.T, tenant, key, host string)
	}{
		{"memory", masterv1.Medium_MEDIUM_MEMORY, func(t *testing.T, tenant, key, host string) {
			h.Corrupt(tenant, key, h.replicaOn(t, tenant, key, host))
		}},
		{"disk", masterv1.Medium_MEDIUM_DISK, func(t *testing.T, tenant, key, host string) {
			corruptDisk(t, h, diskDirs[:], tenant, key, host)
		}},
	}
	paths(t, func(t *testing.T, transfer bool) {
		c := h.pathClient(t, transfer) // on host-0: reads host-0's replica first
		tenant := c.TenantName()
		ctx := t.Context()
		data := pattern(300<<10+7, 11) // streamed in several chunks
		size := int64(len(data))
		for _, m := range media {
			t.Run(m.name, func(t *testing.T) {
				// put stores key, corrupts its replicas on the hosts named and
				// returns its replicas.
				put := func(key string, corrupt ...string) []*masterv1.ReplicaDescriptor {
					t.Helper()
					key = m.name + "/" + key
					if err := c.Put(ctx, key, data, client.WithReplicas(2), client.WithMedium(m.medium)); err != nil {
						t.Fatalf("Put %s: %v", key, err)
					}
					info, err := c.Stat(ctx, key)
					if err != nil || len(info.Replicas) != 2 || info.Replicas[0].GetMedium() != m.medium {
						t.Fatalf("Stat %s: %+v, %v; want 2 replicas on %v", key, info, err, m.medium)
					}
					for _, host := range corrupt {
						m.corrupt(t, tenant, key, host)
					}
					return info.Replicas
				}

				// Not rewindable: the corrupt bytes stay in w.
				put("buffer", "host-0")
				var buf bytes.Buffer
				if n, err := c.GetTo(ctx, m.name+"/buffer", onlyWriter{&buf}, nil); !errors.Is(err, client.ErrChecksum) || n != size {
					t.Fatalf("GetTo into a writer without Seek: %d bytes, %v; want %d bytes and ErrChecksum", n, err, size)
				}
				put("pipe", "host-0")
				pr, pw, err := os.Pipe()
				if err != nil {
					t.Fatal(err)
				}
				drained := make(chan []byte)
				go func() {
					b, _ := io.ReadAll(pr)
					drained <- b
				}()
				n, err := c.GetTo(ctx, m.name+"/pipe", pw, nil)
				_ = pw.Close()
				got := <-drained
				_ = pr.Close()
				if !errors.Is(err, client.ErrChecksum) || n != size || len(got) != len(data) || bytes.Equal(got, data) {
					t.Fatalf("GetTo into a pipe: %d bytes (%d through, equal %v), %v; want the %d corrupt bytes and ErrChecksum",
						n, len(got), bytes.Equal(got, data), err, size)
				}

				// Rewindable: the next replica's bytes replace the corrupt ones.
				prefix := []byte("kept before the object")
				put("file", "host-0")
				f := fileAt(t, prefix)
				var restarts int
				var last int64
				n, err = c.GetTo(ctx, m.name+"/file", f, func(done, total int64) {
					if total != size {
						t.Errorf("progress total %d, want %d", total, size)
					}
					if done < last {
						if done != 0 {
							t.Errorf("progress went back from %d to %d, want to 0", last, done)
						}
						restarts++
					}
					last = done
				})
				if err != nil || n != size {
					t.Fatalf("GetTo into a file with host-0's replica corrupt: %d bytes, %v", n, err)
				}
				if restarts != 1 || last != size {
					t.Errorf("progress restarted %d times and ended at %d; want once, at %d", restarts, last, size)
				}
				if got := fileBytes(t, f); !bytes.Equal(got, append(bytes.Clone(prefix), data...)) {
					t.Fatalf("the file holds %d bytes, want the %d-byte prefix and the %d-byte object", len(got), len(prefix), len(data))
				}

				// Every replica corrupt: rewound after each, both named.
				reps := put("all", "host-0", "host-1")
				f = fileAt(t, prefix)
				n, err = c.GetTo(ctx, m.name+"/all", f, nil)
				if !errors.Is(err, client.ErrChecksum) || n != 0 {
					t.Fatalf("GetTo with both replicas corrupt: %d bytes, %v; want 0 and ErrChecksum", n, err)
				}
				for _, r := range reps {
					if want := fmt.Sprintf("replica %d on %s", r.GetReplicaId(), r.GetDataEndpoint()); !strings.Contains(err.Error(), want) {
						t.Errorf("error %q does not name %q", err, want)
					}
				}
				// The second round's fresh list may still hold a replica
				// its agent has just dropped (the report in flight): at
				// least one CHECKSUM_MISMATCH per replica.
				if strings.Count(err.Error(), "CHECKSUM_MISMATCH") < 2 {
					t.Errorf("error %q: want a CHECKSUM_MISMATCH per replica", err)
				}
				if got := fileBytes(t, f); !bytes.Equal(got, prefix) {
					t.Fatalf("after the failed GetTo the file holds %d bytes, want the %d-byte prefix alone", len(got), len(prefix))
				}
			})
		}
	})
}

// fileAt returns a new file in t.TempDir() holding prefix, positioned after it.
func fileAt(t *testing.T, prefix []byte) *os.File {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "out"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	if _, err := f.Write(prefix); err != nil {
		t.Fatal(err)
	}
	return f
}

func fileBytes(t *testing.T, f *os.File) []byte {
	t.Helper()
	b, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// corruptDisk flips the first byte of key's replica on host (agent i runs
// on host-i) in the agent's disk segment data file, as a failing disk
// would: the agent reads it back with pread, through the same page cache.
func corruptDisk(t *testing.T, h *harness, dirs []string, tenant, key, host string) {
	t.Helper()
	resp, err := masterv1.NewObjectServiceClient(h.Conn()).GetReplicaList(t.Context(), &masterv1.GetReplicaListRequest{Tenant: tenant, Key: key})
	if err != nil {
		t.Fatalf("GetReplicaList %q: %v", key, err)
	}
	var r *masterv1.ReplicaDescriptor
	for _, d := range resp.GetReplicas() {
		if d.GetHostId() == host {
			r = d
		}
	}
	if r == nil {
		t.Fatalf("%q has no replica on %s", key, host)
	}
	var i int
	if _, err := fmt.Sscanf(host, "host-%d", &i); err != nil {
		t.Fatalf("host %q: %v", host, err)
	}
	seg, ok := h.Agent(i).Segments().Get(r.GetSegmentId())
	if !ok || seg.Medium() != masterv1.Medium_MEDIUM_DISK {
		t.Fatalf("agent %d has no disk segment %s", i, r.GetSegmentId())
	}
	a, ok := seg.Lookup(r.GetAllocationId())
	if !ok {
		t.Fatalf("segment %s has no allocation %d", r.GetSegmentId(), r.GetAllocationId())
	}
	f, err := os.OpenFile(filepath.Join(dirs[i], "segment.data"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, int64(a.GetOffset())); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, int64(a.GetOffset())); err != nil {
		t.Fatal(err)
	}
}
