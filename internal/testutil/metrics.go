package testutil

import (
	"io"
	"net/http"
	"testing"
)

// Metrics returns the Prometheus text a server's plaintext admin listener
// at addr serves on /metrics, failing tb when it cannot be read.
func Metrics(tb testing.TB, addr string) string {
	tb.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		tb.Fatal(err)
	}
	return string(b)
}
