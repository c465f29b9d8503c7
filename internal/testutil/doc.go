// Package testutil is the test scaffolding Crescent's packages share:
// Eventually (a polling waiter that honours the test's context), a discard
// logger, a fake clock, an in-memory fake cluster (a master's
// ObjectService and AdminService plus agents serving DataService and the
// bulk transfer protocol, all on loopback ports) for the SDK's and the
// CLI's tests and examples, and a scripted KV-event PUB endpoint.
//
// It imports neither pkg/client nor pkg/kvevent, so the tests of both
// packages (internal and external) may import it. Internal to the Crescent
// module: only its tests use it.
package testutil
