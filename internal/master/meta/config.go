package meta

import (
	"fmt"
	"time"

	"github.com/crescent-kv/crescent/internal/master/changelog"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/prometheus/client_golang/prometheus"
)

// Config tunes the metadata. Zero values take the defaults listed.
type Config struct {
	// Shards is the number of metadata shards, a power of two (default 256).
	Shards int
	// LeaseTTL is the read lease granted by Get and Exist (default 10 s).
	LeaseTTL time.Duration
	// SoftPinTTL is the default soft pin lifetime (default 30 min);
	// MaxSoftPinTTL caps a requested one (default 24 h).
	SoftPinTTL    time.Duration
	MaxSoftPinTTL time.Duration
	// PutPreemptAfter is the put timeout: a PutStart not ended within it
	// may be preempted by a new PutStart on the same key, and the
	// background sweep (Run) expires it — its replicas removed and released
	// at the agents, its quota refunded, nothing published (default 30 s,
	// Mooncake's). Keep it below the agents' reserved grace (the master's
	// --reserved-grace, 60 s), so that the master, which knows the put,
	// releases its reservations before the agents reclaim them blindly.
	PutPreemptAfter time.Duration
	// PutSweepInterval is the period of that sweep (default 1 s).
	PutSweepInterval time.Duration
	// MaxObjectSize refuses PutStarts of larger objects with
	// OBJECT_TOO_LARGE, before any placement or eviction. 0 means the
	// capacity of the largest registered segment (an object no segment can
	// hold is never placed); either way at most MaxObjectSizeCap.
	MaxObjectSize uint64
	// WriteTokenTTL is how long PutStart's write tokens last (default 5 min).
	WriteTokenTTL time.Duration
	// HighWatermark and LowWatermark are segment fill ratios: eviction starts
	// at high (default 0.90) and stops at low (default 0.80).
	HighWatermark float64
	LowWatermark  float64
	// EvictInterval is the period of the background eviction check
	// (default 1 s).
	EvictInterval time.Duration
	// EvictPolicy is what the background eviction check does with a
	// memory segment's victims (issue 17 item 3): EvictOffload (the
	// default, "") moves them to a disk segment with room, or drops them
	// when no disk segment can take them; EvictDrop drops them. Disk
	// segments' victims, and the victims of a PutStart that found no room,
	// are always dropped.
	EvictPolicy EvictPolicy
	// ChangeRetention is the number of change records retained (default
	// changelog.DefaultRetention).
	ChangeRetention int
	// MaxTenants bounds the number of tenants held at once (default 65536,
	// at most MaxTenantsLimit); a new one beyond it fails with
	// LIMIT_EXCEEDED. Tenants that hold nothing and have no quota are
	// dropped, so this counts live ones.
	MaxTenants int
	// ScanBudget is how many keys one RemoveByPrefix/RemoveByRegex call
	// examines before it answers with a page token (default
	// DefaultScanBudget); a RemoveByRegex page also ends once its matching
	// work reaches matchBudget.
	ScanBudget int
	// PromoteThreshold is how many counted reads of an object with no
	// memory replica (within the sketch's decay) queue it for promotion to
	// memory (default 3, at most 255); negative disables the counting (and
	// so background promotion; Prefetch still works).
	PromoteThreshold int
	// PromoteQueue bounds the promotion queue (default 4096); a key that
	// finds it full is dropped and counted.
	PromoteQueue int
	// PromoteBytesPerSec is the promotion worker's byte-rate budget
	// (default 128 MiB/s); Prefetch with wait is not held to it.
	PromoteBytesPerSec uint64
	// PromoteHalveEvery halves every counter of the read sketch after this
	// many counted reads (default 1<<18), so old reads fade.
	PromoteHalveEvery int
	// BlankPool is how many blank reservations the master keeps per
	// segment and object size (blank.go): a PutStart that finds one skips
	// the agent's Reserve round trip. Default 8; negative disables them.
	BlankPool int
	// BlankMaxAge is how long a blank may wait for a put before it is
	// released (default 30 s). Keep it at most half the agents' reserved
	// grace, so that an agent never frees a blank the master hands out.
	BlankMaxAge time.Duration
}

func (c Config) withDefaults() Config {
	if c.Shards <= 0 {
		c.Shards = 256
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = 10 * time.Second
	}
	if c.SoftPinTTL <= 0 {
		c.SoftPinTTL = 30 * time.Minute
	}
	if c.MaxSoftPinTTL <= 0 {
		c.MaxSoftPinTTL = 24 * time.Hour
	}
	if c.PutPreemptAfter <= 0 {
		c.PutPreemptAfter = 30 * time.Second
	}
	if c.PutSweepInterval <= 0 {
		c.PutSweepInterval = time.Second
	}
	if c.WriteTokenTTL <= 0 {
		c.WriteTokenTTL = 5 * time.Minute
	}
	if c.HighWatermark <= 0 {
		c.HighWatermark = 0.90
	}
	if c.LowWatermark <= 0 {
		c.LowWatermark = 0.80
	}
	if c.EvictInterval <= 0 {
		c.EvictInterval = time.Second
	}
	if c.ChangeRetention <= 0 {
		c.ChangeRetention = changelog.DefaultRetention
	}
	if c.MaxTenants <= 0 {
		c.MaxTenants = 1 << 16
	}
	if c.ScanBudget <= 0 {
		c.ScanBudget = DefaultScanBudget
	}
	if c.EvictPolicy == "" {
		c.EvictPolicy = EvictOffload
	}
	if c.PromoteThreshold == 0 {
		c.PromoteThreshold = DefaultPromoteThreshold
	}
	if c.PromoteQueue <= 0 {
		c.PromoteQueue = 4096
	}
	if c.PromoteBytesPerSec == 0 {
		c.PromoteBytesPerSec = 128 << 20
	}
	if c.PromoteHalveEvery <= 0 {
		c.PromoteHalveEvery = 1 << 18
	}
	if c.BlankPool == 0 {
		c.BlankPool = 8
	}
	if c.BlankMaxAge <= 0 {
		c.BlankMaxAge = 30 * time.Second
	}
	return c
}

// Validate reports a configuration that cannot work.
func (c Config) Validate() error {
	c = c.withDefaults()
	if c.Shards&(c.Shards-1) != 0 {
		return fmt.Errorf("meta: shards %d is not a power of two", c.Shards)
	}
	if c.LowWatermark >= c.HighWatermark || c.HighWatermark > 1 {
		return fmt.Errorf("meta: watermarks low %.2f high %.2f: want 0 < low < high <= 1", c.LowWatermark, c.HighWatermark)
	}
	if c.SoftPinTTL > c.MaxSoftPinTTL {
		return fmt.Errorf("meta: soft pin ttl %v exceeds max %v", c.SoftPinTTL, c.MaxSoftPinTTL)
	}
	if _, err := ParseEvictPolicy(string(c.EvictPolicy)); err != nil {
		return fmt.Errorf("meta: %w", err)
	}
	if c.PromoteThreshold > sketchMax {
		return fmt.Errorf("meta: promote threshold %d exceeds the sketch's %d", c.PromoteThreshold, sketchMax)
	}
	if c.MaxObjectSize > MaxObjectSizeCap {
		return fmt.Errorf("meta: max object size %d exceeds the cap %d", c.MaxObjectSize, uint64(MaxObjectSizeCap))
	}
	return nil
}

// EvictPolicy says what the background eviction does with a memory
// segment's victims.
type EvictPolicy string

const (
	// EvictOffload moves them to a disk segment that has room (same host
	// first) and drops only those that find none; with no disk segment it
	// is EvictDrop.
	EvictOffload EvictPolicy = "offload"
	// EvictDrop drops them (removes the objects), as before issue 17.
	EvictDrop EvictPolicy = "drop"
)

// ParseEvictPolicy parses "offload" or "drop" ("" is offload).
func ParseEvictPolicy(v string) (EvictPolicy, error) {
	switch EvictPolicy(v) {
	case "", EvictOffload:
		return EvictOffload, nil
	case EvictDrop:
		return EvictDrop, nil
	}
	return "", fmt.Errorf("evict policy %q: want offload or drop", v)
}

// DefaultPromoteThreshold is the default Config.PromoteThreshold.
const DefaultPromoteThreshold = 3

// Deps are the metadata's collaborators.
type Deps struct {
	Registry cluster.Registry
	Agents   cluster.Agents
	Identity cluster.Identity
	// Now is the clock (default time.Now); tests move it.
	Now func() time.Time
	// Metrics receives the metadata's collectors; nil registers nothing.
	Metrics prometheus.Registerer
}

// Store is the object metadata. Create it with New; it implements
