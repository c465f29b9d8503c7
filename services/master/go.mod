module github.com/crescent-kv/crescent/services/master

go 1.26
