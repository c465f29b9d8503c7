package ctl

import (
	"errors"
	"testing"
)

func TestFirstOf(t *testing.T) {
	a, b, c := errors.New("put \"k/0\": NO_AVAILABLE_HANDLE"), errors.New("put \"k/1\": x"), errors.New("put \"k/2\": y")
	for _, tc := range []struct {
		err  error
		want string
	}{
		{a, a.Error()},
		{errors.Join(a), a.Error()},
		{errors.Join(a, b, c), `put "k/0": NO_AVAILABLE_HANDLE (and 2 more in that call)`},
	} {
		if got := firstOf(tc.err); got != tc.want {
			t.Errorf("firstOf(%q) = %q, want %q", tc.err, got, tc.want)
		}
	}
}
