package meta

import (
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// Replica status values stored in replica.status (masterv1.ReplicaStatus).
const (
	stProcessing = uint8(masterv1.ReplicaStatus_REPLICA_STATUS_PROCESSING)
	stComplete   = uint8(masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE)
	stFailed     = uint8(masterv1.ReplicaStatus_REPLICA_STATUS_FAILED)
)

// replica is one copy of an object: 32 bytes.
type replica struct {
	allocID uint64 // allocation id at the agent; valid unless pending
	offset  uint64 // byte offset of the allocation in its segment (hole-making eviction)
	seg     uint32 // segment table index
	id      uint32 // per-object, monotonic, never reused while the object exists
	status  uint8
	medium  uint8
	// pending: the reservation at the agent is in flight; allocID unknown.
	pending bool
}

// Object flags.
const (
	flagHardPin uint8 = 1 << iota
	flagSoftPin
	flagLeased
)

// object is one (tenant, key): 112 bytes, a size class of its own
// (TestObjectSize), plus its replica array. The key string is shared with
// the change records; the group id and the soft pin expiry live in the
// shard (groupOf, softPinLocked).
type object struct {
	key      string
	size     uint64
	checksum uint64
	// accessMs is the last read (or the completion) time, Unix ms: the
	// eviction clock. With flagLeased, the read lease lasts until
	// accessMs+LeaseTTL. Write it only through shard.touchLocked (or
	// mut.touchLater), which keep the shard's recency list in order.
	accessMs int64
	// prev and next link the object into its shard's recency list (see
	// shard); both nil when it is not linked.
	prev, next *object
	// sealedMs is when the current version became COMPLETE (Reconcile's
	// "newer sealed wins").
	sealedMs int64
	put      *putState // the write in progress, nil when none
	replicas []replica
	nextRID  uint32
	tenant   uint32
	// group is the group id, interned in the shard (shard.groupOf).
	group uint32
	// flags: with flagSoftPin the expiry is in the shard's pins map
	// (shard.softPinLocked).
	flags uint8
}

// putState is a write in progress (PutStart → PutEnd/PutRevoke). Set and
// clear object.put only through shard.startPutLocked and endPutLocked,
// which keep the shard's put list.
type putState struct {
	client     string
	seq        uint64 // store-wide identity of this put (async re-lookup)
	startMs    int64
	softPinTTL time.Duration
	phase      uint8
	// obj is the object this put writes; prev and next link the put into
	// its shard's put list (see putList).
	obj        *object
	prev, next *putState
}

// Put phases.
const (
	phasePlacing uint8 = iota // reservations in flight; descriptors not yet returned
	phaseOpen                 // descriptors returned; the client writes
	phaseSealing              // PutEnd is sealing at the agents
)

func (o *object) leased(nowMs int64, ttl time.Duration) bool {
	return o.flags&flagLeased != 0 && nowMs < o.accessMs+ttl.Milliseconds()
}

func (o *object) hasComplete() bool {
	for i := range o.replicas {
		if o.replicas[i].status == stComplete {
			return true
		}
	}
	return false
}

func (o *object) hasCompleteOn(medium uint8, except int) bool {
	for i := range o.replicas {
		if i != except && o.replicas[i].status == stComplete && o.replicas[i].medium == medium {
			return true
		}
	}
	return false
}

func (o *object) replicaIndex(id uint32) int {
	for i := range o.replicas {
		if o.replicas[i].id == id {
			return i
		}
	}
	return -1
}

// allocIndex is the index of o's replica at allocation id of segment seg
// (never a pending one: its allocation is not known yet), or -1.
func (o *object) allocIndex(seg uint32, id uint64) int {
	for i, rp := range o.replicas {
		if rp.seg == seg && !rp.pending && rp.allocID == id {
			return i
		}
	}
	return -1
}
