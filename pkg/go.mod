module github.com/crescent-kv/crescent/pkg

go 1.26
