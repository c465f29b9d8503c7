package server

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/crescent-kv/crescent/internal/auth"
)

// DefaultHealthURL is what Healthcheck probes without a URL.
const DefaultHealthURL = "http://127.0.0.1:9003/readyz"

// Healthcheck implements the `<binary> healthcheck URL` subcommand used by
// container health checks (images are FROM scratch: no curl). It GETs URL
// (default DefaultHealthURL) and returns the process exit code: 0 for a 2xx
// answer, 1 otherwise.
func Healthcheck(args []string, out io.Writer) int {
	u := DefaultHealthURL
	if len(args) > 0 {
		u = args[0]
	}
	return healthcheck(u, Security{}, out)
}

// healthcheck GETs u; an https URL is verified against sec's CA (and
// offers sec's certificate, when it names one).
func healthcheck(u string, sec Security, out io.Writer) int {
	fail := func(err any) int {
		fmt.Fprintln(out, "healthcheck:", err)
		return 1
	}
	tr := &http.Transport{DisableKeepAlives: true}
	if strings.HasPrefix(u, "https://") {
		if sec.CA == "" {
			return fail("an https URL needs the CA: set --tls-ca (or CRESCENT_TLS_CA)")
		}
		pu, err := url.Parse(u)
		if err != nil {
			return fail(err)
		}
		src, err := auth.NewSource(sec.Files(), slog.New(slog.DiscardHandler))
		if err != nil {
			return fail(err)
		}
		tr.TLSClientConfig = src.ClientTLS(pu.Hostname())
	}
	client := &http.Client{Transport: tr}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return fail(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return fail(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fail(resp.Status)
	}
	return 0
}

// httpsURL turns the default http:// health URL into https:// for a
// process whose admin port serves TLS.
func httpsURL(u string) string {
	if rest, ok := strings.CutPrefix(u, "http://"); ok {
		return "https://" + rest
	}
	return u
}
