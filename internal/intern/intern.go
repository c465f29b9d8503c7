// Package intern keeps counted string tables: a holder of many records
// that repeat a few client-chosen strings (group ids) stores a uint32 per
// record instead of a 16-byte string header, and every record of one
// string shares its bytes. Entries are counted and freed with their last
// reference, so a client that makes up strings without end cannot grow a
// table past the records that use it.
package intern

// Table is a counted string table. Index 0 is the empty string, always
// present and never counted. The zero Table is ready to use. It is not
// safe for concurrent use: its holder's lock guards it.
type Table struct {
	names []string
	refs  []uint32
	idx   map[string]uint32
	free  []uint32
}

// Name is the string at index i (i must be 0 or held).
func (t *Table) Name(i uint32) string {
	if i == 0 {
		return ""
	}
	return t.names[i]
}

// Intern returns s's index, counting one more reference to it.
func (t *Table) Intern(s string) uint32 {
	if s == "" {
		return 0
	}
	if t.idx == nil {
		t.names, t.refs, t.idx = []string{""}, []uint32{0}, make(map[string]uint32)
	}
	i, ok := t.idx[s]
	if !ok {
		if n := len(t.free); n > 0 {
			i, t.free = t.free[n-1], t.free[:n-1]
			t.names[i] = s
		} else {
			i = uint32(len(t.names))
			t.names = append(t.names, s)
			t.refs = append(t.refs, 0)
		}
		t.idx[s] = i
	}
	t.refs[i]++
	return i
}

// Release drops one reference to index i, freeing it with its last.
func (t *Table) Release(i uint32) {
	if i == 0 {
		return
	}
	if t.refs[i]--; t.refs[i] == 0 {
		delete(t.idx, t.names[i])
		t.names[i] = ""
		t.free = append(t.free, i)
	}
}

// Len is the number of strings held, "" not counted.
func (t *Table) Len() int { return len(t.idx) }

// Refs is the number of references to index i.
func (t *Table) Refs(i uint32) uint32 {
	if i == 0 {
		return 0
	}
	return t.refs[i]
}
