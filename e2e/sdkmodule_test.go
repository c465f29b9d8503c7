package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/mod/module"
	"golang.org/x/mod/zip"
)

// crescentModule is the product module's path.
const crescentModule = "github.com/crescent-kv/crescent"

// An inference-engine connector outside this repository can depend on the
// SDK through ordinary module resolution: the repository's committed HEAD is
// served as a module version from a file-based GOPROXY (exactly the .info,
// .mod and .zip files a proxy serves, the zip made by golang.org/x/mod/zip
// from git as the go command does), and a throwaway module outside the tree,
// with no replace directive and no workspace, requires that version, imports
// pkg/client and pkg/kvevent, and builds.
func TestSDKIsGoGettable(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a module outside the tree")
	}
	if tlsMode(t) {
		t.Skipf("starts no cluster, so %s changes nothing in it: the plaintext run covers it (and a minute of CI is saved)", tlsEnv)
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("git is not installed")
	}
	if err := exec.Command("git", "-C", root, "rev-parse", "--verify", "HEAD").Run(); err != nil {
		t.Skip("not a git checkout with a commit")
	}
	rev := strings.TrimSpace(run(t, root, nil, "git", "rev-parse", "HEAD"))
	when := time.Now().UTC()
	version := fmt.Sprintf("v0.0.0-%s-%s", when.Format("20060102150405"), rev[:12])

	// The proxy: <proxy>/<module>/@v/{list,V.info,V.mod,V.zip}.
	proxy := t.TempDir()
	dir := filepath.Join(proxy, crescentModule, "@v")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	zf, err := os.Create(filepath.Join(dir, version+".zip"))
	if err != nil {
		t.Fatal(err)
	}
	if err := zip.CreateFromVCS(zf, module.Version{Path: crescentModule, Version: version}, root, rev, ""); err != nil {
		t.Fatalf("module zip of HEAD: %v", err)
	}
	if err := zf.Close(); err != nil {
		t.Fatal(err)
	}
	gomod := run(t, root, nil, "git", "show", rev+":go.mod")
	info, _ := json.Marshal(map[string]any{"Version": version, "Time": when.Format(time.RFC3339)})
	for name, data := range map[string]string{"list": version + "\n", version + ".info": string(info), version + ".mod": gomod} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}

	// The connector: a module of its own, outside the repository.
	app := t.TempDir()
	files := map[string]string{
		"go.mod": "module example.com/connector\n\ngo 1.26.0\n\nrequire " + crescentModule + " " + version + "\n",
		"main.go": `package main

import (
	"context"
	"fmt"

	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

func main() {
	c, err := client.New(context.Background(), client.Config{Master: "127.0.0.1:1"})
	if err == nil {
		defer c.Close()
	}
	fmt.Println(err == nil, kvevent.Options{}.MaxMessage)
}
`,
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(app, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	goproxy := strings.TrimSpace(run(t, root, nil, "go", "env", "GOPROXY"))
	env := []string{
		"GOWORK=off", // no workspace: real module resolution
		"GOFLAGS=-mod=mod",
		"GOPROXY=file://" + filepath.ToSlash(proxy) + "," + goproxy, // ours first, the SDK's dependencies from the cache or the usual proxy
		"GONOSUMDB=" + crescentModule,                               // a version the checksum database has never seen
		"GOTOOLCHAIN=local",
	}
	run(t, app, env, "go", "mod", "tidy")
	sum, err := os.ReadFile(filepath.Join(app, "go.sum"))
	if err != nil || !strings.Contains(string(sum), crescentModule+" "+version+" h1:") {
		t.Fatalf("go.sum of the connector does not pin %s %s: %v\n%s", crescentModule, version, err, sum)
	}
	run(t, app, env, "go", "build", "-o", filepath.Join(app, "connector"), ".")
	if req := run(t, app, env, "go", "list", "-m", crescentModule); strings.TrimSpace(req) != crescentModule+" "+version {
		t.Fatalf("the connector resolved %q, want %s %s", req, crescentModule, version)
	}
}

// run runs a command in dir with env added and returns its standard output.
func run(t *testing.T, dir string, env []string, name string, args ...string) string {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, stderr.String())
	}
	return string(out)
}
