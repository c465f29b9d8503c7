package token

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"sync"
)

// Seal receipts (issue 18 item 2). An agent that verified and sealed an
// allocation as its write completed (the bulk transfer's seal_checksum)
// answers the client with a receipt; the client passes it in PutEnd and the
// master commits the replica without a Seal round trip to the agent. The
// receipt is a MAC under a key derived from the master's token key, which
// the agent holds (Settings): only an agent the master trusts can make one,
// and the master checks it without asking anybody.
//
// The MAC key of a receipt is HMAC-SHA256(token secret, receiptDomain), not
// the token secret itself, so a token can never be replayed as a receipt
// nor a receipt as a token, whatever their bytes.
//
// Wire layout, version 1 (all integers big-endian):
//
//	version u8 (1) | key_id u32 | allocation u64 | size u64 | checksum u64 |
//	epoch u64 | segment_len u8 | segment bytes |
//	HMAC-SHA256 over everything before it, under key key_id's receipt key (32 bytes)
//
// epoch is the master epoch the allocation was reserved under (the
// Reserve command's), so a receipt never outlives the master term that
// placed the allocation.
//
// Version 2 is bound to an object: the receipt of a spare's write (a
// leased blank whose token names no key, bound to the key the write
// names). Its bytes are version 1's with version byte 2; the tenant and
// key are not in them (the master knows which it expects), but the MAC
// covers them:
//
//	HMAC(receipt key, body | tenant_len u16 | tenant | key_len u16 | key)
//
// where body is everything before the MAC. A version 2 receipt opens only
// with the tenant and key it was signed for (OpenObject), so a client
// cannot write one key into a spare and commit another. Version 1 (a
// Receipt with no Key) is unchanged, byte for byte.

// receiptDomain separates receipt keys from token keys.
const receiptDomain = "crescent seal receipt v1"

const (
	receiptVersion = 1
	// receiptVersionObject is version 2, bound to an object.
	receiptVersionObject = 2
	rOffKeyID            = 1
	rOffAlloc            = 5
	rOffSize             = 13
	rOffChecksum         = 21
	rOffEpoch            = 29
	rOffSegLen           = 37
	receiptHeaderLen     = 38
	// MaxReceiptLen is the longest receipt (a 255-byte segment id).
	MaxReceiptLen = receiptHeaderLen + maxSegment + macLen
)

// Receipt is what a seal receipt asserts: the agent sealed allocation
// AllocationID of segment SegmentID, Size bytes with checksum Checksum,
// reserved under master epoch Epoch — and, in version 2, that it holds
// tenant Tenant's key Key.
type Receipt struct {
	// KeyID names the token key the receipt key derives from. ParseReceipt
	// and OpenObject set it; signing writes the signer's key id.
	KeyID        uint32
	SegmentID    string
	AllocationID uint64
	Size         uint64
	Checksum     uint64
	Epoch        uint64
	// Tenant and Key bind the receipt to an object: signing a Receipt
	// whose Key is not empty makes a version 2 receipt. OpenObject of a
	// version 2 receipt sets them to the ones it verified; version 1 and
	// ParseReceipt leave them empty (they are not in the bytes).
	Tenant, Key string
}

// receiptKey derives the receipt MAC key from a token secret.
func receiptKey(secret []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(receiptDomain))
	return m.Sum(nil)
}

// appendReceiptBody appends the bytes of receipt r before its MAC: version
// 2 when r names a key.
func appendReceiptBody(b []byte, id uint32, r Receipt) []byte {
	seg := clip(r.SegmentID, maxSegment)
	if b == nil {
		b = make([]byte, 0, receiptHeaderLen+len(seg)+macLen)
	}
	v := byte(receiptVersion)
	if r.Key != "" {
		v = receiptVersionObject
	}
	b = append(b, v)
	b = binary.BigEndian.AppendUint32(b, id)
	b = binary.BigEndian.AppendUint64(b, r.AllocationID)
	b = binary.BigEndian.AppendUint64(b, r.Size)
	b = binary.BigEndian.AppendUint64(b, r.Checksum)
	b = binary.BigEndian.AppendUint64(b, r.Epoch)
	b = append(b, byte(len(seg)))
	return append(b, seg...)
}

// appendObject appends what a version 2 receipt's MAC covers after its
// body: tenant_len u16 | tenant | key_len u16 | key (over-long strings cut,
// as in tokens).
func appendObject(b []byte, tenant, key string) []byte {
	tenant, key = clip(tenant, maxString), clip(key, maxString)
	b = binary.BigEndian.AppendUint16(b, uint16(len(tenant)))
	b = append(b, tenant...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(key)))
	return append(b, key...)
}

// SignReceipt returns the receipt r under k's receipt key (version 2 when
// r.Key is not empty). It is the reference ReceiptKeys is checked against.
func SignReceipt(k SigningKey, r Receipt) []byte {
	m := hmac.New(sha256.New, receiptKey(k.Secret))
	b := appendReceiptBody(nil, k.ID, r)
	m.Write(b)
	if r.Key != "" {
		m.Write(appendObject(nil, r.Tenant, r.Key))
	}
	return m.Sum(b)
}

// splitReceipt checks a receipt's framing (version 1 or 2) and returns its
// key id, signed body and MAC.
func splitReceipt(b []byte) (id uint32, body, mac []byte, err error) {
	if len(b) < receiptHeaderLen+macLen || len(b) > MaxReceiptLen || (b[0] != receiptVersion && b[0] != receiptVersionObject) {
		return 0, nil, nil, ErrMalformed
	}
	n := receiptHeaderLen + int(b[rOffSegLen])
	if len(b) != n+macLen {
		return 0, nil, nil, ErrMalformed
	}
	return binary.BigEndian.Uint32(b[rOffKeyID:]), b[:n], b[n:], nil
}

func receiptClaims(id uint32, body []byte) Receipt {
	return Receipt{
		KeyID:        id,
		AllocationID: binary.BigEndian.Uint64(body[rOffAlloc:]),
		Size:         binary.BigEndian.Uint64(body[rOffSize:]),
		Checksum:     binary.BigEndian.Uint64(body[rOffChecksum:]),
		Epoch:        binary.BigEndian.Uint64(body[rOffEpoch:]),
		SegmentID:    string(body[receiptHeaderLen:]),
	}
}

// ParseReceipt decodes a receipt's claims, version 1 or 2, without checking
// its MAC (for diagnostics and the fuzz target; OpenObject is what trusts
// one). Tenant and Key stay empty: a version 2 receipt does not carry them.
func ParseReceipt(b []byte) (Receipt, error) {
	id, body, _, err := splitReceipt(b)
	if err != nil {
		return Receipt{}, err
	}
	return receiptClaims(id, body), nil
}

// ReceiptKeys signs and opens receipts under the receipt keys derived from
// a set of token keys, with pooled keyed HMAC states. Immutable; safe for
// concurrent use.
type ReceiptKeys struct {
	keys []receiptKeyState
}

type receiptKeyState struct {
	id   uint32
	macs macPool
}

// NewReceiptKeys derives the receipt keys of keys (newest first: Sign uses
// the first).
func NewReceiptKeys(keys ...SigningKey) *ReceiptKeys {
	rk := &ReceiptKeys{keys: make([]receiptKeyState, len(keys))}
	for i, k := range keys {
		rk.keys[i] = receiptKeyState{id: k.ID, macs: newMACPool(receiptKey(k.Secret))}
	}
	return rk
}

// Sign returns the receipt r under the first key (version 2 when r.Key is
// not empty), identical to SignReceipt's; nil when there is no key.
func (rk *ReceiptKeys) Sign(r Receipt) []byte {
	if rk == nil || len(rk.keys) == 0 {
		return nil
	}
	k := &rk.keys[0]
	b := appendReceiptBody(nil, k.id, r)
	if r.Key == "" {
		return k.macs.sum(b, b)
	}
	return k.macs.sumObject(b, b, r.Tenant, r.Key)
}

// Open is OpenObject(b, "", ""): it opens version 1 receipts only (a
// version 2 one fails ErrSignature).
func (rk *ReceiptKeys) Open(b []byte) (Receipt, error) { return rk.OpenObject(b, "", "") }

// OpenObject checks a receipt's framing and MAC and returns its claims:
// ErrMalformed, ErrUnknownKey (a key rotated out, or another master's) or
// ErrSignature otherwise. A version 1 receipt ignores tenant and key (its
// claims leave them empty); a version 2 one opens only when its MAC covers
// tenant and key (a non-empty key), which its claims then hold:
// ErrSignature for any other object. The caller compares the claims with
// what it expects — a put that needs its receipt bound to its key checks
// that the claims' Key is the key (a version 1 receipt's is empty).
func (rk *ReceiptKeys) OpenObject(b []byte, tenant, key string) (Receipt, error) {
	id, body, mac, err := splitReceipt(b)
	if err != nil {
		return Receipt{}, err
	}
	if rk != nil {
		for i := range rk.keys {
			if rk.keys[i].id != id {
				continue
			}
			macs := rk.keys[i].macs
			if body[0] == receiptVersion {
				if !macs.equal(body, mac) {
					return Receipt{}, ErrSignature
				}
				return receiptClaims(id, body), nil
			}
			// Version 2: no signer binds an empty key.
			if key == "" || !macs.equalObject(body, tenant, key, mac) {
				return Receipt{}, ErrSignature
			}
			r := receiptClaims(id, body)
			r.Tenant, r.Key = tenant, key
			return r, nil
		}
	}
	return Receipt{}, ErrUnknownKey
}

// receiptKeysOnce caches a ringState's ReceiptKeys.
type receiptKeysOnce struct {
	once sync.Once
	rk   *ReceiptKeys
}

// ReceiptKeys returns the receipt keys of the ring's keys (those agents
// hold), derived once per rotation; nil for a nil Ring (which opens no
// receipt).
func (r *Ring) ReceiptKeys() *ReceiptKeys {
	if r == nil {
		return nil
	}
	st := r.st.Load()
	st.receipts.once.Do(func() { st.receipts.rk = NewReceiptKeys(st.keys...) })
	return st.receipts.rk
}
