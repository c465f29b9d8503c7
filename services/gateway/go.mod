module github.com/crescent-kv/crescent/services/gateway

go 1.26
