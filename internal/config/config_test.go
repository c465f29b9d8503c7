package config

import (
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestLoadPriority(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "c.yaml")
	if err := os.WriteFile(file, []byte("addr: file\nsize: 2GiB\ntimeout: 3s\nname: file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	addr := fs.String("addr", "default", "")
	name := fs.String("name", "default", "")
	timeout := fs.Duration("timeout", time.Second, "")
	size := ByteSize(1 << 20)
	fs.Var(&size, "size", "")
	env := map[string]string{"CRESCENT_NAME": "env", "CRESCENT_ADDR": "env"}
	err := Load(fs, []string{"--config", file, "--addr", "flag"}, func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err != nil {
		t.Fatal(err)
	}
	if *addr != "flag" || *name != "env" || *timeout != 3*time.Second || size != 2<<30 {
		t.Fatalf("got addr=%s name=%s timeout=%v size=%d", *addr, *name, *timeout, size)
	}
}

func TestLoadErrors(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "c.yaml")
	_ = os.WriteFile(file, []byte("nope: 1\n"), 0o600)
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	if err := Load(fs, []string{"--config", file}, func(string) (string, bool) { return "", false }); err == nil {
		t.Fatal("unknown key must fail")
	}
	fs = flag.NewFlagSet("t", flag.ContinueOnError)
	var s ByteSize
	fs.Var(&s, "size", "")
	if err := Load(fs, nil, func(k string) (string, bool) { return "12 parsecs", k == "CRESCENT_SIZE" }); err == nil {
		t.Fatal("bad env value must fail")
	}
}

func TestByteSize(t *testing.T) {
	for in, want := range map[string]uint64{"4096": 4096, "1GiB": 1 << 30, "512MiB": 512 << 20, "1G": 1 << 30, "2KB": 2000, "1.5KiB": 1536} {
		got, err := ParseByteSize(in)
		if err != nil || uint64(got) != want {
			t.Errorf("ParseByteSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "abc", "-1", "1XB"} {
		if _, err := ParseByteSize(bad); err == nil {
			t.Errorf("ParseByteSize(%q) should fail", bad)
		}
	}
}
