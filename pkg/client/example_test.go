package client_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/pkg/client"
)

// The examples run against a real cluster started in-process on loopback
// ports (internal/testcluster: a master and two agents), so `go test` runs
// them and checks their output. Against a cluster of your own, Master is
// the master's address, e.g. "localhost:50051" after `make run`.

// startCluster starts the cluster and returns its master address.
func startCluster() (addr string, stop func()) {
	c, stop := testcluster.StartExample(testcluster.Options{Agents: 2})
	return c.MasterAddr(), stop
}

// A connector storing and fetching KV blocks: put a batch, read it back
// into buffers it owns, remove one.
func Example() {
	master, stop := startCluster()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := client.New(ctx, client.Config{Master: master, Tenant: "llama-70b"})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	blocks := []client.Item{
		{Key: "prefix/0", Data: make([]byte, 4096)},
		{Key: "prefix/1", Data: make([]byte, 4096)},
	}
	for i, err := range c.BatchPut(ctx, blocks, client.WithReplicas(2)) {
		if err != nil && !errors.Is(err, client.ErrExists) {
			log.Fatalf("put %s: %v", blocks[i].Key, err)
		}
	}

	bufs := [][]byte{make([]byte, 4096), make([]byte, 4096)}
	sizes, errs := c.BatchGetInto(ctx, []string{"prefix/0", "prefix/1"}, bufs)
	for i, err := range errs {
		if errors.Is(err, client.ErrNotFound) {
			continue // evicted meanwhile: recompute the block
		}
		fmt.Println(i, sizes[i], err)
	}

	// The reads above hold a lease for a few seconds: Remove refuses
	// without force.
	err = c.Remove(ctx, "prefix/1", false)
	fmt.Println(errors.Is(err, client.ErrLeased))
	// Output:
	// 0 4096 <nil>
	// 1 4096 <nil>
	// true
}

// New connects lazily: the first call waits for the master.
func ExampleNew() {
	master, stop := startCluster()
	defer stop()
	c, err := client.New(context.Background(), client.Config{Master: master, Tenant: "llama-70b"})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	fmt.Println(c.TenantName(), c.Tenant("mistral-7b").TenantName())
	// Output: llama-70b mistral-7b
}

// Put stores an object on as many replicas as asked; Get reads the
// nearest one and verifies its checksum.
func ExampleClient_Put() {
	master, stop := startCluster()
	defer stop()
	ctx := context.Background()
	c, err := client.New(ctx, client.Config{Master: master})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	if err := c.Put(ctx, "block-0", []byte("kv bytes"), client.WithReplicas(2), client.WithSoftPin(time.Hour)); err != nil {
		log.Fatal(err)
	}
	err = c.Put(ctx, "block-0", []byte("other bytes"))
	fmt.Println(errors.Is(err, client.ErrExists))

	got, err := c.Get(ctx, "block-0")
	if err != nil {
		log.Fatal(err)
	}
	info, err := c.Stat(ctx, "block-0")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s: %d bytes on %d replicas\n", got, info.Size, len(info.Replicas))

	_, err = c.Get(ctx, "block-1")
	fmt.Println(errors.Is(err, client.ErrNotFound))
	// Output:
	// true
	// kv bytes: 8 bytes on 2 replicas
	// true
}

// BatchPut and BatchGet move many small objects in a few calls, with one
// error per item.
func ExampleClient_BatchGet() {
	master, stop := startCluster()
	defer stop()
	ctx := context.Background()
	c, err := client.New(ctx, client.Config{Master: master})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	items := []client.Item{{Key: "a", Data: []byte("alpha")}, {Key: "b", Data: []byte("beta")}}
	for i, err := range c.BatchPut(ctx, items) {
		if err != nil {
			log.Fatalf("put %s: %v", items[i].Key, err)
		}
	}
	data, errs := c.BatchGet(ctx, []string{"a", "b", "c"})
	for i, err := range errs {
		switch {
		case errors.Is(err, client.ErrNotFound):
			fmt.Println(i, "not found")
		case err != nil:
			log.Fatal(err)
		default:
			fmt.Println(i, string(data[i]))
		}
	}
	// Output:
	// 0 alpha
	// 1 beta
	// 2 not found
}

// Remove refuses while a reader holds a lease, unless forced;
// RemoveByPrefix removes a whole namespace.
func ExampleClient_Remove() {
	master, stop := startCluster()
	defer stop()
	ctx := context.Background()
	c, err := client.New(ctx, client.Config{Master: master})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	for _, k := range []string{"seq-1/0", "seq-1/1", "seq-2/0"} {
		if err := c.Put(ctx, k, []byte(k)); err != nil {
			log.Fatal(err)
		}
	}
	if _, err := c.Get(ctx, "seq-2/0"); err != nil { // takes a read lease
		log.Fatal(err)
	}
	err = c.Remove(ctx, "seq-2/0", false)
	fmt.Println(errors.Is(err, client.ErrLeased))
	fmt.Println(c.Remove(ctx, "seq-2/0", true))

	removed, skipped, err := c.RemoveByPrefix(ctx, "seq-1/", false)
	fmt.Println(removed, skipped, err)
	// Output:
	// true
	// <nil>
	// 2 0 <nil>
}

// List pages through a tenant's objects in key order.
func ExampleClient_List() {
	master, stop := startCluster()
	defer stop()
	ctx := context.Background()
	c, err := client.New(ctx, client.Config{Master: master})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	for _, k := range []string{"b", "a", "c"} {
		if err := c.Put(ctx, k, []byte("x"+k)); err != nil {
			log.Fatal(err)
		}
	}
	for o, err := range c.List(ctx, "") {
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(o.GetKey(), o.GetSize())
	}
	// Output:
	// a 2
	// b 2
	// c 2
}
