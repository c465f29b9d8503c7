package server

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"
)

// Healthcheck implements the `<binary> healthcheck URL` subcommand used by
// container health checks (images are FROM scratch: no curl). It GETs URL
// (default http://127.0.0.1:9003/readyz) and returns the process exit code:
// 0 for a 2xx answer, 1 otherwise.
func Healthcheck(args []string, out io.Writer) int {
	url := "http://127.0.0.1:9003/readyz"
	if len(args) > 0 {
		url = args[0]
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		fmt.Fprintln(out, "healthcheck:", err)
		return 1
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		fmt.Fprintln(out, "healthcheck:", err)
		return 1
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		fmt.Fprintln(out, "healthcheck:", resp.Status)
		return 1
	}
	return 0
}
