package ctl

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc"
)

// fakeMaster is a hand-written master for crescentctl's tests (the real
// one lives in another module's internal packages): segment lifecycles for
// drain and undrain, and a prefix removal that answers in pages of
// pageSize keys, as the master's scan budget does.
type fakeMaster struct {
	masterv1.UnimplementedAdminServiceServer
	masterv1.UnimplementedObjectServiceServer

	pageSize int

	mu    sync.Mutex
	segs  map[string]masterv1.SegmentLifecycle
	keys  map[string]bool
	calls int // RemoveByPrefix calls
}

func (f *fakeMaster) segment(id string) *masterv1.Segment {
	return &masterv1.Segment{Info: &masterv1.SegmentInfo{SegmentId: id}, Lifecycle: f.segs[id]}
}

func (f *fakeMaster) DrainSegment(_ context.Context, r *masterv1.DrainSegmentRequest) (*masterv1.DrainSegmentResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.segs[r.GetSegmentId()]; !ok {
		return nil, rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "segment %q not found", r.GetSegmentId()))
	}
	f.segs[r.GetSegmentId()] = masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_DRAINED
	return &masterv1.DrainSegmentResponse{Segment: f.segment(r.GetSegmentId())}, nil
}

func (f *fakeMaster) UndrainSegment(_ context.Context, r *masterv1.UndrainSegmentRequest) (*masterv1.UndrainSegmentResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	lc, ok := f.segs[r.GetSegmentId()]
	switch {
	case !ok:
		return nil, rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "segment %q not found", r.GetSegmentId()))
	case lc == masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTING:
		return nil, rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_UNAVAILABLE, "segment %q is unmounting", r.GetSegmentId()))
	}
	f.segs[r.GetSegmentId()] = masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK
	return &masterv1.UndrainSegmentResponse{Segment: f.segment(r.GetSegmentId())}, nil
}

func (f *fakeMaster) RemoveByPrefix(_ context.Context, r *masterv1.RemoveByPrefixRequest) (*masterv1.RemoveByPrefixResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	resp := &masterv1.RemoveByPrefixResponse{}
	var match []string
	for k := range f.keys {
		if strings.HasPrefix(k, r.GetPrefix()) {
			match = append(match, k)
		}
	}
	slices.Sort(match)
	if len(match) > f.pageSize {
		match = match[:f.pageSize]
		resp.NextPageToken = "after-" + match[len(match)-1]
	}
	for _, k := range match {
		delete(f.keys, k)
	}
	resp.Removed = uint64(len(match))
	return resp, nil
}

func startFakeMaster(t *testing.T, f *fakeMaster) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(rpccodec.ServerOption())
	masterv1.RegisterAdminServiceServer(gs, f)
	masterv1.RegisterObjectServiceServer(gs, f)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(lis)
	}()
	t.Cleanup(func() {
		gs.Stop()
		<-done
	})
	return lis.Addr().String()
}

func run(t *testing.T, addr string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = Main(t.Context(), append([]string{"--master", addr}, args...), strings.NewReader(""), &out, &errb)
	return code, out.String(), errb.String()
}

func TestDrainUndo(t *testing.T) {
	f := &fakeMaster{segs: map[string]masterv1.SegmentLifecycle{
		"s1": masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_OK,
		"s2": masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTING,
	}}
	addr := startFakeMaster(t, f)
	for _, tc := range []struct {
		args     []string
		code     int
		out, err string
	}{
		{[]string{"drain", "s1"}, ExitOK, "segment s1: DRAINED\n", ""},
		{[]string{"drain", "--undo", "s1"}, ExitOK, "segment s1: OK\n", ""},
		{[]string{"drain", "--undo", "s1"}, ExitOK, "segment s1: OK\n", ""},
		{[]string{"-o", "json", "drain", "--undo", "s1"}, ExitOK, `{"lifecycle":"OK","segment_id":"s1"}` + "\n", ""},
		{[]string{"drain", "--undo", "s2"}, ExitError, "", "SEGMENT_UNAVAILABLE"},
		{[]string{"drain", "--undo", "nope"}, ExitError, "", "SEGMENT_NOT_FOUND"},
	} {
		code, out, errOut := run(t, addr, tc.args...)
		if code != tc.code || out != tc.out || !strings.Contains(errOut, tc.err) {
			t.Errorf("crescentctl %v: got exit %d, stdout %q, stderr %q; want %d, %q, stderr containing %q", tc.args, code, out, errOut, tc.code, tc.out, tc.err)
		}
	}
}

// TestRemovePrefixFollowsPages: the master answers a prefix removal in
// pages; crescentctl rm --prefix follows them and reports the total.
func TestRemovePrefixFollowsPages(t *testing.T) {
	f := &fakeMaster{pageSize: 7, keys: map[string]bool{}}
	for i := range 50 {
		f.keys[fmt.Sprintf("p/%04d", i)] = true
		f.keys[fmt.Sprintf("q/%04d", i)] = true
	}
	addr := startFakeMaster(t, f)
	code, out, errOut := run(t, addr, "-o", "json", "rm", "--prefix", "p/")
	if code != ExitOK || out != `{"removed":50,"skipped":0}`+"\n" {
		t.Fatalf("rm --prefix: exit %d, stdout %q, stderr %q; want 0 and 50 removed", code, out, errOut)
	}
	if f.calls != 8 || len(f.keys) != 50 {
		t.Fatalf("master saw %d calls and kept %d keys, want 8 pages and the 50 q/ keys", f.calls, len(f.keys))
	}
}
