// Package token signs and verifies the capability tokens that let a client
// touch one allocation at one agent. The master signs them (PutStart and a
// drain's copy: write, GetReplicaList: read) with the current key of its Ring
// and hands every agent the current and previous keys in Settings; the agent
// verifies them without asking the master. A token names the key that signed
// it and binds the object (tenant and key), the replica (segment and
// allocation), the mode and the expiry, so it cannot be replayed against
// another allocation, another object or by another tenant. A write token
// also binds the replica's identity (replica id, group, hard pin): an agent
// writing into a blank reservation (one the master reserved ahead with no
// object, issue 18 item 2) records the object from the token when the
// write opens, so a client cannot rename what it writes.
//
// A *spare* token (the spare flag) is the write token of a blank the
// master leased to a client ahead of its puts (put leases): it names the
// tenant and the replica id but no key, and the agent binds the blank to
// the token's tenant and the key the bulk transfer item names. The flag is
// valid only on a write token with an empty key: Parse and Verify refuse
// any other token that carries it as ErrMalformed (the master never signs
// one), before its MAC is checked.
//
// Wire layout, version 3 (all integers big-endian):
//
//	version u8 (3) | key_id u32 | mode u8 | allocation u64 | expiry_unix_ms i64 |
//	replica_id u32 | flags u8 (bit 0: hard pin, bit 1: spare; others refused) |
//	segment_len u8 | tenant_len u16 | key_len u16 | group_len u16 |
//	segment bytes | tenant bytes | key bytes | group bytes |
//	HMAC-SHA256 over everything before it, under key key_id (32 bytes)
//
// The lengths sit in the fixed 34-byte header, so framing is checked before
// any variable field is read. Older versions (1: no key id, no object; 2:
// no replica identity) are refused as malformed: masters and agents are
// upgraded together, and tokens live minutes.
//
// Internal to the Crescent module: the services, the CLI and pkg/client
// import it; other modules cannot, so it may change in any release.
package token

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"sync"
	"time"
)

// Mode is what a token allows.
type Mode uint8

const (
	// Write allows DataService.Write of a RESERVED allocation.
	Write Mode = 1
	// Read allows DataService.Read of a SEALED allocation.
	Read Mode = 2
)

const (
	version = 3
	macLen  = sha256.Size
	// Header offsets.
	offKeyID   = 1
	offMode    = 5
	offAlloc   = 6
	offExpiry  = 14
	offReplica = 22
	offFlags   = 26
	offSegLen  = 27
	offTenLen  = 28
	offKeyLen  = 30
	offGrpLen  = 32
	headerLen  = 34
	flagHard   = 1
	flagSpare  = 2
	flagsKnown = flagHard | flagSpare
	maxSegment = 1<<8 - 1
	maxString  = 1<<16 - 1
	// KeyLen is the length of a signing key.
	KeyLen = 32
)

// Errors returned by Verify and Parse. They are sentinels; wrap, never
// compare text.
var (
	ErrMalformed = errors.New("token: malformed")
	// ErrUnknownKey: the token names a key id the verifier does not hold
	// (retired by two rotations, or from another master).
	ErrUnknownKey = errors.New("token: unknown key id")
	ErrSignature  = errors.New("token: bad signature")
	ErrExpired    = errors.New("token: expired")
	ErrMismatch   = errors.New("token: not for this allocation or mode")
	// ErrTenant: the caller is a tenant other than the token's.
	ErrTenant = errors.New("token: for another tenant")

	// errSpare is the ErrMalformed of a spare token that is not a write
	// token naming no key. One value, so that errors compare equal.
	errSpare = fmt.Errorf("%w (the spare flag needs a write token that names no key, no group and no hard pin)", ErrMalformed)
)

// Claims are what a token asserts.
type Claims struct {
	// KeyID names the signing key. Parse sets it; Sign and Signer.Sign
	// write their key's id whatever it holds.
	KeyID        uint32
	Mode         Mode
	Tenant       string
	Key          string
	SegmentID    string
	AllocationID uint64
	Expiry       time.Time
	// ReplicaID, Group and HardPin are the replica's identity, which an
	// agent records when a write opens a blank reservation (zero in read
	// tokens).
	ReplicaID uint32
	Group     string
	HardPin   bool
	// Spare marks the write token of a leased blank (a spare): it names no
	// Key, which the write names instead (TransferItem.key). Valid only
	// with Mode Write and an empty Key; Sign writes what it is given, and
	// Parse and Verify refuse anything else as ErrMalformed.
	Spare bool
}

// SigningKey is one HMAC-SHA256 key and the id tokens name it by.
type SigningKey struct {
	ID     uint32
	Secret []byte
}

// NewKey returns a fresh random 32-byte secret.
func NewKey() []byte {
	k := make([]byte, KeyLen)
	if _, err := rand.Read(k); err != nil {
		// crypto/rand never fails on supported platforms (Go 1.24+ it
		// cannot return an error); keep the branch for older contracts.
		panic(fmt.Sprintf("crypto/rand: %v", err))
	}
	return k
}

// Sign returns the token for c under k. It is the reference the pooled
// Signer is checked against; hot paths use a Signer.
func Sign(k SigningKey, c Claims) []byte {
	m := hmac.New(sha256.New, k.Secret)
	b := appendBody(nil, k.ID, c)
	m.Write(b)
	return m.Sum(b)
}

func clip(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// appendBody appends the signed part of the token for c under key id.
// Over-long strings are cut (the master's validation keeps them shorter).
func appendBody(b []byte, id uint32, c Claims) []byte {
	seg, ten, key, grp := clip(c.SegmentID, maxSegment), clip(c.Tenant, maxString), clip(c.Key, maxString), clip(c.Group, maxString)
	if b == nil {
		b = make([]byte, 0, headerLen+len(seg)+len(ten)+len(key)+len(grp)+macLen)
	}
	var flags byte
	if c.HardPin {
		flags |= flagHard
	}
	if c.Spare {
		flags |= flagSpare
	}
	b = append(b, version)
	b = binary.BigEndian.AppendUint32(b, id)
	b = append(b, byte(c.Mode))
	b = binary.BigEndian.AppendUint64(b, c.AllocationID)
	b = binary.BigEndian.AppendUint64(b, uint64(c.Expiry.UnixMilli()))
	b = binary.BigEndian.AppendUint32(b, c.ReplicaID)
	b = append(b, flags)
	b = append(b, byte(len(seg)))
	b = binary.BigEndian.AppendUint16(b, uint16(len(ten)))
	b = binary.BigEndian.AppendUint16(b, uint16(len(key)))
	b = binary.BigEndian.AppendUint16(b, uint16(len(grp)))
	b = append(b, seg...)
	b = append(b, ten...)
	b = append(b, key...)
	return append(b, grp...)
}

// Signer signs tokens under one key like Sign, reusing keyed HMAC states
// (no per-token key schedule), for hot paths that sign many tokens. Safe
// for concurrent use.
type Signer struct {
	id   uint32
	macs macPool
}

// NewSigner returns a Signer for k (its secret copied).
func NewSigner(k SigningKey) *Signer { return &Signer{id: k.ID, macs: newMACPool(k.Secret)} }

// KeyID is the id of the Signer's key.
func (s *Signer) KeyID() uint32 { return s.id }

// Sign returns the token for c, identical to Sign(key, c). One allocation:
// the token.
func (s *Signer) Sign(c Claims) []byte {
	b := appendBody(nil, s.id, c)
	return s.macs.sum(b, b)
}

// macPool keeps keyed HMAC-SHA256 states for reuse: deriving one per token
// (hmac.New's key schedule and allocations) was an eighth of the agent's CPU
// on a 4 KiB batch read. Safe for concurrent use.
type macPool struct{ pool *sync.Pool }

// macState is one pooled keyed state and the buffer a verification sums
// into (a stack buffer would escape through hash.Hash.Sum: one allocation
// per token).
type macState struct {
	h   hash.Hash
	sum [macLen]byte
	// obj is scratch for a version 2 receipt's tenant and key.
	obj []byte
}

// maxKeptObject bounds the scratch a pooled macState keeps.
const maxKeptObject = 4 << 10

func newMACPool(key []byte) macPool {
	k := append([]byte(nil), key...)
	return macPool{pool: &sync.Pool{New: func() any { return &macState{h: hmac.New(sha256.New, k)} }}}
}

// sum appends the MAC of body to dst.
func (p macPool) sum(dst, body []byte) []byte {
	st := p.pool.Get().(*macState)
	st.h.Reset()
	st.h.Write(body)
	dst = st.h.Sum(dst)
	p.pool.Put(st)
	return dst
}

// sumObject appends to dst the MAC of body | appendObject(tenant, key) (a
// version 2 receipt's). dst may share body's array past len(body): body is
// hashed before anything is appended.
func (p macPool) sumObject(dst, body []byte, tenant, key string) []byte {
	st := p.pool.Get().(*macState)
	st.h.Reset()
	st.h.Write(body)
	st.obj = appendObject(st.obj[:0], tenant, key)
	st.h.Write(st.obj)
	dst = st.h.Sum(dst)
	p.put(st)
	return dst
}

// equalObject reports whether mac is the MAC of body | appendObject(tenant,
// key) (constant time).
func (p macPool) equalObject(body []byte, tenant, key string, mac []byte) bool {
	st := p.pool.Get().(*macState)
	st.h.Reset()
	st.h.Write(body)
	st.obj = appendObject(st.obj[:0], tenant, key)
	st.h.Write(st.obj)
	ok := hmac.Equal(st.h.Sum(st.sum[:0]), mac)
	p.put(st)
	return ok
}

// put returns st to the pool, without a scratch buffer grown past
// maxKeptObject.
func (p macPool) put(st *macState) {
	if cap(st.obj) > maxKeptObject {
		st.obj = nil
	}
	p.pool.Put(st)
}

// equal reports whether mac is the MAC of body (constant time), allocating
// nothing.
func (p macPool) equal(body, mac []byte) bool {
	st := p.pool.Get().(*macState)
	st.h.Reset()
	st.h.Write(body)
	ok := hmac.Equal(st.h.Sum(st.sum[:0]), mac)
	p.pool.Put(st)
	return ok
}

// split checks a token's framing and returns its key id, signed body and
// MAC. A spare flag on anything but a write token with no key, no group
// and no hard pin is malformed (errSpare): a spare is a blank reservation,
// and its object's identity comes with the put that claims it.
func split(tok []byte) (id uint32, body, mac []byte, err error) {
	if len(tok) < headerLen+macLen || tok[0] != version || tok[offFlags]&^flagsKnown != 0 {
		return 0, nil, nil, ErrMalformed
	}
	keyLen := binary.BigEndian.Uint16(tok[offKeyLen:])
	n := headerLen + int(tok[offSegLen]) + int(binary.BigEndian.Uint16(tok[offTenLen:])) +
		int(keyLen) + int(binary.BigEndian.Uint16(tok[offGrpLen:]))
	if len(tok) != n+macLen {
		return 0, nil, nil, ErrMalformed
	}
	if tok[offFlags]&flagSpare != 0 && (Mode(tok[offMode]) != Write || keyLen != 0 ||
		binary.BigEndian.Uint16(tok[offGrpLen:]) != 0 || tok[offFlags]&flagHard != 0) {
		return 0, nil, nil, errSpare
	}
	return binary.BigEndian.Uint32(tok[offKeyID:]), tok[:n], tok[n:], nil
}

// fields returns views of a framed body's segment, tenant, key and group.
func fields(body []byte) (seg, tenant, key, group []byte) {
	s := headerLen + int(body[offSegLen])
	t := s + int(binary.BigEndian.Uint16(body[offTenLen:]))
	k := t + int(binary.BigEndian.Uint16(body[offKeyLen:]))
	return body[headerLen:s], body[s:t], body[t:k], body[k:]
}

// Request is what a data-plane call wants to do; Verify checks a token
// against it.
type Request struct {
	Mode         Mode
	SegmentID    string
	AllocationID uint64
	// CallerTenant is the caller's tenant when the caller is known to be a
	// tenant principal; "" (unknown, or an agent or admin) skips the check.
	CallerTenant string
}

// Object is the object and replica a verified token names: views into the
// token, valid while it is. The agent compares the tenant and key with the
// allocation's own (the object its Reserve named), or records them all in
// a blank reservation.
type Object struct {
	Tenant, Key, Group []byte
	ReplicaID          uint32
	HardPin            bool
	// Spare: a spare's write token (Claims.Spare); Key is empty, and the
	// write names the key.
	Spare bool
}

// Is reports whether o names tenant's key.
func (o Object) Is(tenant, key string) bool {
	return string(o.Tenant) == tenant && string(o.Key) == key
}

// checkClaims compares a verified body's claims with the request.
func checkClaims(body []byte, r *Request, now time.Time) (Object, error) {
	seg, tenant, key, group := fields(body)
	if Mode(body[offMode]) != r.Mode || string(seg) != r.SegmentID || binary.BigEndian.Uint64(body[offAlloc:]) != r.AllocationID {
		return Object{}, ErrMismatch
	}
	if r.CallerTenant != "" && string(tenant) != r.CallerTenant {
		return Object{}, ErrTenant
	}
	if now.After(time.UnixMilli(int64(binary.BigEndian.Uint64(body[offExpiry:])))) {
		return Object{}, ErrExpired
	}
	return Object{Tenant: tenant, Key: key, Group: group, ReplicaID: binary.BigEndian.Uint32(body[offReplica:]),
		HardPin: body[offFlags]&flagHard != 0, Spare: body[offFlags]&flagSpare != 0}, nil
}

// find returns the key id names among keys.
func find(keys []SigningKey, id uint32) (SigningKey, bool) {
	for _, k := range keys {
		if k.ID == id {
			return k, true
		}
	}
	return SigningKey{}, false
}

// Parse decodes a token and checks its signature under the key it names
// among keys, but not its claims.
func Parse(tok []byte, keys ...SigningKey) (Claims, error) {
	id, body, mac, err := split(tok)
	if err != nil {
		return Claims{}, err
	}
	k, ok := find(keys, id)
	if !ok {
		return Claims{}, ErrUnknownKey
	}
	m := hmac.New(sha256.New, k.Secret)
	m.Write(body)
	if !hmac.Equal(m.Sum(nil), mac) {
		return Claims{}, ErrSignature
	}
	seg, tenant, key, group := fields(body)
	return Claims{
		KeyID:        id,
		Mode:         Mode(body[offMode]),
		AllocationID: binary.BigEndian.Uint64(body[offAlloc:]),
		Expiry:       time.UnixMilli(int64(binary.BigEndian.Uint64(body[offExpiry:]))),
		SegmentID:    string(seg),
		Tenant:       string(tenant),
		Key:          string(key),
		ReplicaID:    binary.BigEndian.Uint32(body[offReplica:]),
		Group:        string(group),
		HardPin:      body[offFlags]&flagHard != 0,
		Spare:        body[offFlags]&flagSpare != 0,
	}, nil
}

// Verify checks that tok is a valid, unexpired token for r at time now under
// one of keys, and returns the object it names. It is the reference the
// pooled Verifier is checked against.
func Verify(tok []byte, r Request, now time.Time, keys ...SigningKey) (Object, error) {
	id, body, mac, err := split(tok)
	if err != nil {
		return Object{}, err
	}
	k, ok := find(keys, id)
	if !ok {
		return Object{}, ErrUnknownKey
	}
	m := hmac.New(sha256.New, k.Secret)
	m.Write(body)
	if !hmac.Equal(m.Sum(nil), mac) {
		return Object{}, ErrSignature
	}
	return checkClaims(body, &r, now)
}

// Verifier checks tokens against a set of keys like Verify, with pooled
// keyed HMAC states per key (see macPool). Immutable; safe for concurrent
// use.
type Verifier struct {
	keys []verifierKey
}

type verifierKey struct {
	SigningKey
	macs macPool
}

// NewVerifier returns a Verifier for keys (copied).
func NewVerifier(keys ...SigningKey) *Verifier { return (*Verifier)(nil).Rekey(keys...) }

// Rekey returns a Verifier for keys that reuses v's pooled states for the
// keys v already holds (same id and secret), so re-sent Settings do not
// cool the pools. v may be nil.
func (v *Verifier) Rekey(keys ...SigningKey) *Verifier {
	n := &Verifier{keys: make([]verifierKey, 0, len(keys))}
	for _, k := range keys {
		if old, ok := v.lookup(k.ID); ok && hmac.Equal(old.Secret, k.Secret) {
			n.keys = append(n.keys, *old)
			continue
		}
		n.keys = append(n.keys, verifierKey{SigningKey: SigningKey{ID: k.ID, Secret: append([]byte(nil), k.Secret...)}, macs: newMACPool(k.Secret)})
	}
	return n
}

// KeyIDs lists the ids of v's keys in the order given.
func (v *Verifier) KeyIDs() []uint32 {
	ids := make([]uint32, len(v.keys))
	for i := range v.keys {
		ids[i] = v.keys[i].ID
	}
	return ids
}

func (v *Verifier) lookup(id uint32) (*verifierKey, bool) {
	if v == nil {
		return nil, false
	}
	for i := range v.keys {
		if v.keys[i].ID == id {
			return &v.keys[i], true
		}
	}
	return nil, false
}

// Verify is the package-level Verify with v's keys. It allocates nothing.
func (v *Verifier) Verify(tok []byte, r Request, now time.Time) (Object, error) {
	id, body, mac, err := split(tok)
	if err != nil {
		return Object{}, err
	}
	k, ok := v.lookup(id)
	if !ok {
		return Object{}, ErrUnknownKey
	}
	if !k.macs.equal(body, mac) {
		return Object{}, ErrSignature
	}
	return checkClaims(body, &r, now)
}
