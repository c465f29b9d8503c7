module github.com/crescent-kv/crescent/services/agent

go 1.26

require (
	github.com/crescent-kv/crescent/gen v0.0.0-00010101000000-000000000000
	github.com/crescent-kv/crescent/pkg v0.0.0-00010101000000-000000000000
)

replace (
	github.com/crescent-kv/crescent/gen => ../../gen
	github.com/crescent-kv/crescent/pkg => ../../pkg
)
