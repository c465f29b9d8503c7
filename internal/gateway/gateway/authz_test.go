package gateway

import (
	"testing"

	"github.com/crescent-kv/crescent/internal/server"
)

// TestAuthTableCoversEveryMethod fails when an RPC is added to the
// gateway's services without a rule in authTable (it would be refused to
// everyone with TLS on).
func TestAuthTableCoversEveryMethod(t *testing.T) {
	if err := server.CheckTable(authTable(), authServices...); err != nil {
		t.Fatal(err)
	}
}
