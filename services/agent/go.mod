module github.com/crescent-kv/crescent/services/agent

go 1.26.0

require pgregory.net/rapid v1.3.0

replace (
	github.com/crescent-kv/crescent/gen => ../../gen
	github.com/crescent-kv/crescent/pkg => ../../pkg
)
