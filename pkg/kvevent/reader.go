package kvevent

// reader is a bounds-checked msgpack cursor.
type reader struct {
	b   []byte
	off int
}

func (r *reader) need(n int) error {
	if n < 0 || len(r.b)-r.off < n {
		return malformed("truncated at byte %d (need %d more)", r.off, n)
	}
	return nil
}

func (r *reader) byte() (byte, error) {
	if err := r.need(1); err != nil {
		return 0, err
	}
	c := r.b[r.off]
	r.off++
	return c, nil
}

func (r *reader) be(n int) (uint64, error) {
	if err := r.need(n); err != nil {
		return 0, err
	}
	var v uint64
	for _, c := range r.b[r.off : r.off+n] {
		v = v<<8 | uint64(c)
	}
	r.off += n
	return v, nil
}

// nilNext consumes a nil if one is next.
func (r *reader) nilNext() bool {
	if r.off < len(r.b) && r.b[r.off] == 0xc0 {
		r.off++
		return true
	}
	return false
}

func typeName(c byte) string {
	switch {
	case c <= 0x7f || c >= 0xe0 || (c >= 0xcc && c <= 0xd3):
		return "integer"
	case c <= 0x8f || c == 0xde || c == 0xdf:
		return "map"
	case c <= 0x9f || c == 0xdc || c == 0xdd:
		return "array"
	case c <= 0xbf || (c >= 0xd9 && c <= 0xdb):
		return "string"
	case c == 0xc0:
		return "nil"
	case c == 0xc2 || c == 0xc3:
		return "bool"
	case c >= 0xc4 && c <= 0xc6:
		return "binary"
	case c == 0xca || c == 0xcb:
		return "float"
	case c == 0xc1:
		return "never-used byte 0xc1"
	default:
		return "extension"
	}
}

// uint reads a non-negative integer no larger than max, in any msgpack
// integer encoding; floats, negatives and other types are errors.
func (r *reader) uint(max uint64) (uint64, error) {
	c, err := r.byte()
	if err != nil {
		return 0, err
	}
	var v uint64
	switch {
	case c <= 0x7f:
		v = uint64(c)
	case c >= 0xe0:
		return 0, malformed("negative integer %d", int8(c))
	case c >= 0xcc && c <= 0xcf:
		if v, err = r.be(1 << (c - 0xcc)); err != nil {
			return 0, err
		}
	case c >= 0xd0 && c <= 0xd3:
		size := 1 << (c - 0xd0)
		u, err := r.be(size)
		if err != nil {
			return 0, err
		}
		if u>>(uint(size)*8-1)&1 == 1 {
			return 0, malformed("negative integer")
		}
		v = u
	default:
		return 0, malformed("got %s, want a non-negative integer", typeName(c))
	}
	if v > max {
		return 0, malformed("integer %d out of range (max %d)", v, max)
	}
	return v, nil
}

func (r *reader) str() ([]byte, error) {
	// Fast path: a fixstr that fits (every key and most values).
	if r.off < len(r.b) {
		if c := r.b[r.off]; c >= 0xa0 && c <= 0xbf {
			n := int(c & 0x1f)
			if end := r.off + 1 + n; end <= len(r.b) {
				s := r.b[r.off+1 : end]
				r.off = end
				return s, nil
			}
		}
	}
	c, err := r.byte()
	if err != nil {
		return nil, err
	}
	var n uint64
	switch {
	case c >= 0xa0 && c <= 0xbf:
		n = uint64(c & 0x1f)
	case c == 0xd9:
		n, err = r.be(1)
	case c == 0xda:
		n, err = r.be(2)
	case c == 0xdb:
		n, err = r.be(4)
	default:
		r.off--
		return nil, malformed("got %s, want a string", typeName(c))
	}
	if err != nil {
		return nil, err
	}
	if err := r.need(int(n)); err != nil {
		return nil, err
	}
	s := r.b[r.off : r.off+int(n)]
	r.off += int(n)
	return s, nil
}

// internStr reads a string into *dst, reusing *cache when equal.
func (r *reader) internStr(cache, dst *string) error {
	s, err := r.str()
	if err != nil {
		return err
	}
	if *cache != string(s) {
		*cache = string(s)
	}
	*dst = *cache
	return nil
}

// nullableStr reads a string or nil ("" for nil).
func (r *reader) nullableStr(cache, dst *string) error {
	if r.nilNext() {
		*dst = ""
		return nil
	}
	return r.internStr(cache, dst)
}

func (r *reader) collLen(fix, fixMask, c16, c32 byte, what string) (int, error) {
	c, err := r.byte()
	if err != nil {
		return 0, err
	}
	var n uint64
	switch {
	case c&^fixMask == fix:
		n = uint64(c & fixMask)
	case c == c16:
		n, err = r.be(2)
	case c == c32:
		n, err = r.be(4)
	default:
		return 0, malformed("got %s, want %s", typeName(c), what)
	}
	if err != nil {
		return 0, err
	}
	// Every element takes at least one byte: a length beyond the remaining
	// bytes is a lie, rejected before anyone allocates for it.
	if n > uint64(len(r.b)-r.off) {
		return 0, malformed("%s of %d elements in %d remaining bytes", what, n, len(r.b)-r.off)
	}
	return int(n), nil
}

func (r *reader) arrayLen() (int, error) { return r.collLen(0x90, 0x0f, 0xdc, 0xdd, "an array") }

func (r *reader) mapLen() (int, error) { return r.collLen(0x80, 0x0f, 0xde, 0xdf, "a map") }

// maxDepth bounds nesting when skipping unknown values.
const maxDepth = 32

// skip consumes one value of any type.
func (r *reader) skip(depth int) error {
	if depth > maxDepth {
		return malformed("nesting deeper than %d", maxDepth)
	}
	c, err := r.byte()
	if err != nil {
		return err
	}
	var n uint64
	switch {
	case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		return nil
	case c <= 0x8f:
		return r.skipN(2*int(c&0x0f), depth)
	case c <= 0x9f:
		return r.skipN(int(c&0x0f), depth)
	case c <= 0xbf:
		n = uint64(c & 0x1f)
	case c == 0xc4 || c == 0xd9:
		n, err = r.be(1)
	case c == 0xc5 || c == 0xda:
		n, err = r.be(2)
	case c == 0xc6 || c == 0xdb:
		n, err = r.be(4)
	case c == 0xc7 || c == 0xc8 || c == 0xc9:
		if n, err = r.be(1 << (c - 0xc7)); err == nil {
			n++ // type byte
		}
	case c == 0xca:
		n = 4
	case c == 0xcb:
		n = 8
	case c >= 0xcc && c <= 0xd3:
		n = 1 << ((c - 0xcc) & 3)
	case c >= 0xd4 && c <= 0xd8:
		n = 1 + 1<<(c-0xd4)
	case c == 0xdc || c == 0xdd || c == 0xde || c == 0xdf:
		m, err := r.be(2 << ((c - 0xdc) & 1))
		if err != nil {
			return err
		}
		if c >= 0xde {
			m *= 2
		}
		if m > uint64(len(r.b)-r.off) {
			return malformed("collection of %d elements in %d remaining bytes", m, len(r.b)-r.off)
		}
		return r.skipN(int(m), depth)
	default:
		return malformed("got %s", typeName(c))
	}
	if err != nil {
		return err
	}
	if n > uint64(len(r.b)-r.off) {
		return malformed("truncated value")
	}
	r.off += int(n)
	return nil
}

func (r *reader) skipN(n, depth int) error {
	for range n {
		if err := r.skip(depth + 1); err != nil {
			return err
		}
	}
	return nil
}
