package client_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/crescent-kv/crescent/pkg/client"
)

// A connector storing and fetching KV blocks: put a batch, read it back
// into buffers it owns, remove one. (Needs a running cluster: make run.)
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := client.New(ctx, client.Config{Master: "localhost:50051", Tenant: "llama-70b"})
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
}
