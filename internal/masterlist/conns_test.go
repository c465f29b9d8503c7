package masterlist

import (
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
)

// TestConns: one connection per address, kept; one for an address outside
// the list, replaced by the next such address; none after Close.
func TestConns(t *testing.T) {
	c, err := NewConns([]string{"a:1", "b:1"}, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	a1, _ := c.Get("a:1")
	if a2, _ := c.Get("a:1"); a2 != a1 {
		t.Fatal("a second Get of a listed address made another connection")
	}
	x, _ := c.Get("x:9")
	if _, err := c.Get("y:9"); err != nil {
		t.Fatal(err)
	}
	if x.GetState() != connectivity.Shutdown {
		t.Fatal("the connection to the previous hint outside the list was kept")
	}
	if a1.GetState() == connectivity.Shutdown {
		t.Fatal("a listed address's connection was closed by a hint")
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal("Close twice:", err)
	}
	if _, err := c.Get("a:1"); err == nil {
		t.Fatal("Get after Close")
	}
	if _, err := NewConns(nil); err == nil {
		t.Fatal("an empty list was accepted")
	}
}
