module github.com/crescent-kv/crescent/services/agent

go 1.26
