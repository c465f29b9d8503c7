// Package testutil is the test scaffolding Crescent's packages share:
// Eventually (a polling waiter that honours the test's context), a discard
// logger, a fake clock, a byte-flipping helper, and a scripted KV-event
// PUB endpoint for pkg/kvevent's unit tests. A real cluster for tests —
// master, agents and gateway in one process — is internal/testcluster.
//
// It imports neither pkg/client nor pkg/kvevent, so the tests of both
// packages (internal and external) may import it. Internal to the Crescent
// module: only its tests use it.
package testutil
