package client

import (
	"context"
	"fmt"
	"iter"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
)

// Exist reports whether key is readable (and, when it is, takes a read lease).
func (c *Client) Exist(ctx context.Context, key string) (bool, error) {
	ok, err := c.s.co.exist.do(ctx, &masterv1.ExistRequest{Tenant: c.tenant, Key: key})
	if err != nil {
		return false, fmt.Errorf("exist %q: %w", key, err)
	}
	return ok, nil
}

// Info describes an object and every replica of it.
type Info struct {
	Key      string
	Size     uint64
	Checksum uint64
	GroupID  string
	Replicas []*masterv1.ReplicaDescriptor
}

// Media returns the media on which the object is readable.
func (i *Info) Media() []masterv1.Medium {
	var out []masterv1.Medium
	seen := map[masterv1.Medium]bool{}
	for _, r := range i.Replicas {
		if r.GetStatus() == masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE && !seen[r.GetMedium()] {
			seen[r.GetMedium()] = true
			out = append(out, r.GetMedium())
		}
	}
	return out
}

// Stat describes an object without reading it or taking a lease.
func (c *Client) Stat(ctx context.Context, key string) (*Info, error) {
	r, err := call(c, func(s masterv1.ObjectServiceClient) (*masterv1.QueryRouteResponse, error) {
		return s.QueryRoute(ctx, &masterv1.QueryRouteRequest{Tenant: c.tenant, Key: key})
	})
	if err != nil {
		return nil, fmt.Errorf("stat %q: %w", key, err)
	}
	return &Info{Key: key, Size: r.GetSize(), Checksum: r.GetChecksum(), GroupID: r.GetGroupId(), Replicas: r.GetReplicas()}, nil
}

// Remove deletes key. Without force it fails with ErrLeased while a reader
// holds a lease and with ErrBusy while it is being written or hard-pinned.
func (c *Client) Remove(ctx context.Context, key string, force bool) error {
	_, err := call(c, func(s masterv1.ObjectServiceClient) (*masterv1.RemoveResponse, error) {
		return s.Remove(ctx, &masterv1.RemoveRequest{Tenant: c.tenant, Key: key, Force: force})
	})
	if err != nil {
		return fmt.Errorf("remove %q: %w", key, err)
	}
	return nil
}

// RemoveAll removes every removable object of the tenant and reports how many
// were removed and skipped.
func (c *Client) RemoveAll(ctx context.Context, force bool) (removed, skipped uint64, err error) {
	r, err := call(c, func(s masterv1.ObjectServiceClient) (*masterv1.RemoveAllResponse, error) {
		return s.RemoveAll(ctx, &masterv1.RemoveAllRequest{Tenant: c.tenant, Force: force})
	})
	if err != nil {
		return 0, 0, fmt.Errorf("remove all: %w", err)
	}
	return r.GetRemoved(), r.GetSkipped(), nil
}

// RemoveByPrefix removes the tenant's objects whose key starts with prefix.
// The master scans a bounded number of keys per call; this follows its page
// tokens until the scan is complete.
func (c *Client) RemoveByPrefix(ctx context.Context, prefix string, force bool) (removed, skipped uint64, err error) {
	token := ""
	for {
		r, err := call(c, func(s masterv1.ObjectServiceClient) (*masterv1.RemoveByPrefixResponse, error) {
			return s.RemoveByPrefix(ctx, &masterv1.RemoveByPrefixRequest{Tenant: c.tenant, Prefix: prefix, Force: force, PageToken: token})
		})
		if err != nil {
			return removed, skipped, fmt.Errorf("remove prefix %q: %w", prefix, err)
		}
		removed, skipped, token = removed+r.GetRemoved(), skipped+r.GetSkipped(), r.GetNextPageToken()
		if token == "" {
			return removed, skipped, nil
		}
	}
}

// RemoveByRegex removes the tenant's objects whose key matches an RE2 regex,
// following the master's page tokens like RemoveByPrefix.
func (c *Client) RemoveByRegex(ctx context.Context, regex string, force bool) (removed, skipped uint64, err error) {
	token := ""
	for {
		r, err := call(c, func(s masterv1.ObjectServiceClient) (*masterv1.RemoveByRegexResponse, error) {
			return s.RemoveByRegex(ctx, &masterv1.RemoveByRegexRequest{Tenant: c.tenant, Regex: regex, Force: force, PageToken: token})
		})
		if err != nil {
			return removed, skipped, fmt.Errorf("remove regex %q: %w", regex, err)
		}
		removed, skipped, token = removed+r.GetRemoved(), skipped+r.GetSkipped(), r.GetNextPageToken()
		if token == "" {
			return removed, skipped, nil
		}
	}
}

// List iterates over the tenant's objects whose key starts with prefix, in
// key order, fetching pages as it goes. Stop early by breaking the loop.
func (c *Client) List(ctx context.Context, prefix string) iter.Seq2[*masterv1.ObjectInfo, error] {
	return func(yield func(*masterv1.ObjectInfo, error) bool) {
		token := ""
		for {
			r, err := call(c, func(s masterv1.ObjectServiceClient) (*masterv1.ListObjectsResponse, error) {
				return s.ListObjects(ctx, &masterv1.ListObjectsRequest{Tenant: c.tenant, Prefix: prefix, PageToken: token})
			})
			if err != nil {
				yield(nil, fmt.Errorf("list: %w", err))
				return
			}
			for _, o := range r.GetObjects() {
				if !yield(o, nil) {
					return
				}
			}
			token = r.GetNextPageToken()
			if token == "" {
				return
			}
		}
	}
}

// Checksum returns the object checksum Crescent stores and verifies for
// data: XXH3-64 with seed 0 (xxHash's XXH3_64bits; `xxhsum -H3`, Python's
// xxhash.xxh3_64_intdigest). A caller that drives ObjectService itself
// (grpcurl, another language) passes it in PutEndRequest.checksum.
func Checksum(data []byte) uint64 { return checksum.Sum(data) }
