package client

import (
	"testing"

	"go.uber.org/goleak"
)

// The SDK starts goroutines per call (parallel replica writes, bounded
// batch workers); none may outlive its call and the client's Close.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
