// Package observability holds what an operator loads to watch a Crescent
// cluster (issue 16): Prometheus scrape configs for each way the repository
// runs one (prometheus*.yml), the alert rules (alerts.yml, unit-tested in
// alerts_test.yml) and a Grafana dashboard (crescent-dashboard.json).
//
// Its tests read them with the tools' own parsers — Prometheus's rule-file
// and PromQL parsers, the Grafana foundation SDK's strict dashboard types —
// and check every metric they name against what a real in-process cluster
// exports, so a renamed metric or label fails CI instead of an alert going
// silent. `make check-observability` adds promtool's own checks (check
// config, check rules, test rules).
package observability

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/master/registry"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
	grafanaprom "github.com/grafana/grafana-foundation-sdk/go/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	"go.uber.org/goleak"
	"go.yaml.in/yaml/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

const (
	rulesFile     = "alerts.yml"
	rulesTestFile = "alerts_test.yml"
	dashboardFile = "crescent-dashboard.json"
)

// The jobs every scrape config here names, and the alerts and dashboard
// select on.
var jobs = []string{"crescent-master", "crescent-agent", "crescent-gateway"}

var promql = parser.NewParser(parser.Options{})

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// query is one PromQL expression of the rules or the dashboard, named by
// where it is.
type query struct {
	where, expr string
}

// loadRules parses alerts.yml as Prometheus does (unknown fields refused,
// every expression and template checked) and returns its alerts.
func loadRules(t *testing.T) []rulefmt.Rule {
	t.Helper()
	groups, errs := rulefmt.ParseFile(rulesFile, false, model.UTF8Validation, promql, slog.New(slog.DiscardHandler))
	if len(errs) > 0 {
		t.Fatalf("%s: %v", rulesFile, errs)
	}
	var rules []rulefmt.Rule
	for _, g := range groups.Groups {
		rules = append(rules, g.Rules...)
	}
	return rules
}

// TestAlertRules checks the rule file beyond what Prometheus requires: every
// rule is an alert with a severity, a summary and a description, and every
// alert has a promtool unit test that expects it to fire.
func TestAlertRules(t *testing.T) {
	rules := loadRules(t)
	if len(rules) == 0 {
		t.Fatalf("%s holds no rules", rulesFile)
	}
	fired := firedInUnitTests(t)
	for _, r := range rules {
		if r.Alert == "" {
			t.Errorf("recording rule %q: only alerts belong in %s", r.Record, rulesFile)
			continue
		}
		if s := r.Labels["severity"]; s != "critical" && s != "warning" {
			t.Errorf("%s: severity %q, want critical or warning", r.Alert, s)
		}
		for _, a := range []string{"summary", "description"} {
			if strings.TrimSpace(r.Annotations[a]) == "" {
				t.Errorf("%s: no %s annotation", r.Alert, a)
			}
		}
		if !fired[r.Alert] {
			t.Errorf("%s: no test in %s expects it to fire", r.Alert, rulesTestFile)
		}
	}
}

// firedInUnitTests returns the alerts that some promtool unit test of
// alerts_test.yml expects to fire.
func firedInUnitTests(t *testing.T) map[string]bool {
	t.Helper()
	var doc struct {
		Tests []struct {
			AlertRuleTest []struct {
				Alertname string           `yaml:"alertname"`
				ExpAlerts []map[string]any `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	b, err := os.ReadFile(rulesTestFile)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &doc); err != nil {
		t.Fatalf("%s: %v", rulesTestFile, err)
	}
	fired := map[string]bool{}
	for _, tc := range doc.Tests {
		for _, at := range tc.AlertRuleTest {
			if len(at.ExpAlerts) > 0 {
				fired[at.Alertname] = true
			}
		}
	}
	return fired
}

// grafanaVars are the Grafana variables the dashboard's queries use, with
// a value each for parsing (Grafana substitutes them before Prometheus sees
// the query).
var grafanaVars = strings.NewReplacer("$__rate_interval", "1m", "$__interval", "1m", "$__range", "1h")

// loadDashboard decodes the dashboard strictly into the foundation SDK's
// types, panel options and queries included, and returns its queries.
//
// The dashboard is Grafana's classic JSON model, which every Grafana
// imports and provisions; the SDK deprecates its type in favour of the v2
// schema, which only Grafana 12's new dashboard API takes.
//
//lint:ignore SA1019 the classic model is the one to ship (see above)
func loadDashboard(t *testing.T) (*dashboard.Dashboard, []query) {
	t.Helper()
	plugins.RegisterDefaultPlugins()
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	// The strict decoder checks everything but keeps few values: in SDK
	// v0.0.22 every UnmarshalJSONStrict returns its empty error list as a
	// non-nil error, so the nested ones drop the panels and queries they
	// decoded. Check strictly, then read the values with the lenient one.
	//lint:ignore SA1019 the classic model (see above)
	if err := strict(new(dashboard.Dashboard).UnmarshalJSONStrict(raw)); err != nil {
		t.Fatalf("%s does not decode strictly as a Grafana dashboard: %v", dashboardFile, err)
	}
	var d dashboard.Dashboard //lint:ignore SA1019 the classic model (see above)
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatal(err)
	}
	// Panel.UnmarshalJSONStrict decodes fieldConfig leniently but for its
	// defaults.custom: decode it strictly too.
	var loose struct {
		Panels []struct {
			Title       string          `json:"title"`
			FieldConfig json.RawMessage `json:"fieldConfig"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &loose); err != nil {
		t.Fatal(err)
	}
	for _, p := range loose.Panels {
		if p.FieldConfig == nil {
			continue
		}
		var fc dashboard.FieldConfigSource
		if err := strict(fc.UnmarshalJSONStrict(p.FieldConfig)); err != nil {
			t.Errorf("panel %q: fieldConfig: %v", p.Title, err)
		}
	}

	var qs []query
	for i, pr := range d.Panels {
		if pr.RowPanel != nil {
			if len(pr.RowPanel.Panels) > 0 {
				t.Errorf("row %q holds panels: keep rows expanded, with their panels in the dashboard's list", deref(pr.RowPanel.Title))
			}
			continue
		}
		p := pr.Panel
		if p == nil {
			t.Fatalf("panels[%d] is neither a panel nor a row", i)
		}
		title := deref(p.Title)
		if _, ok := cog.ConfigForPanelcfgVariant(p.Type); !ok {
			t.Errorf("panel %q: type %q is not a panel type the SDK knows, so its options went unchecked", title, p.Type)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", title)
		}
		for _, tg := range p.Targets {
			pq, ok := tg.(*grafanaprom.Dataquery)
			if !ok {
				t.Errorf("panel %q: a %T query, want a Prometheus one (datasource type prometheus)", title, tg)
				continue
			}
			if pq.Datasource == nil || deref(pq.Datasource.Uid) != "${datasource}" {
				t.Errorf("panel %q query %s: datasource %v, want the ${datasource} variable", title, deref(pq.RefId), pq.Datasource)
			}
			qs = append(qs, query{where: fmt.Sprintf("%s: panel %q query %s", dashboardFile, title, deref(pq.RefId)), expr: grafanaVars.Replace(pq.Expr)})
		}
	}
	return &d, qs
}

// strict is the error of a foundation SDK UnmarshalJSONStrict, which
// returns its error list even when it is empty.
func strict(err error) error {
	var list cog.BuildErrors
	if errors.As(err, &list) && len(list) == 0 {
		return nil
	}
	return err
}

func deref[T any](p *T) T {
	var z T
	if p == nil {
		return z
	}
	return *p
}

// TestDashboard checks that the dashboard decodes strictly, that every
// panel is of a known type with Prometheus queries, and that every query
// parses as PromQL.
func TestDashboard(t *testing.T) {
	d, qs := loadDashboard(t)
	if deref(d.Uid) == "" || deref(d.Title) == "" {
		t.Errorf("dashboard uid %q, title %q: both are needed to provision it", deref(d.Uid), deref(d.Title))
	}
	if len(qs) == 0 {
		t.Fatal("the dashboard has no query")
	}
	for _, q := range qs {
		if _, err := promql.ParseExpr(q.expr); err != nil {
			t.Errorf("%s: %v\n%s", q.where, err, q.expr)
		}
	}
}

// scrapeConfig is the part of a Prometheus config file the checks below
// read (promtool check config validates the whole of it).
type scrapeConfig struct {
	RuleFiles     []string `yaml:"rule_files"`
	ScrapeConfigs []struct {
		JobName       string `yaml:"job_name"`
		Scheme        string `yaml:"scheme"`
		StaticConfigs []struct {
			Targets []string `yaml:"targets"`
		} `yaml:"static_configs"`
		TLSConfig struct {
			CertFile string `yaml:"cert_file"`
		} `yaml:"tls_config"`
		Authorization struct {
			CredentialsFile string `yaml:"credentials_file"`
		} `yaml:"authorization"`
		KubernetesSDConfigs []any `yaml:"kubernetes_sd_configs"`
		RelabelConfigs      []struct {
			SourceLabels []string `yaml:"source_labels"`
			Regex        string   `yaml:"regex"`
			Action       string   `yaml:"action"`
		} `yaml:"relabel_configs"`
	} `yaml:"scrape_configs"`
}

func readScrapeConfig(t *testing.T, file string) scrapeConfig {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var c scrapeConfig
	if err := yaml.Unmarshal(b, &c); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	return c
}

// TestScrapeConfigs checks what promtool cannot know: every config loads
// the alerts, the static ones scrape the three jobs, the plaintext one
// scrapes exactly the admin ports of the compose file's default services
// (which `make run` uses too), and the secure ones present an admin
// credential over HTTPS, as /metrics requires with TLS.
func TestScrapeConfigs(t *testing.T) {
	files, err := filepath.Glob("prometheus*.yml")
	if err != nil || len(files) < 5 {
		t.Fatalf("scrape configs %v (%v), want prometheus.yml and its variants", files, err)
	}
	for _, f := range files {
		c := readScrapeConfig(t, f)
		if !slices.Equal(c.RuleFiles, []string{rulesFile}) {
			t.Errorf("%s: rule_files %v, want [%s] (relative to the config file)", f, c.RuleFiles, rulesFile)
		}
		if f == "prometheus-k8s.yml" {
			if len(c.ScrapeConfigs) != 1 || len(c.ScrapeConfigs[0].KubernetesSDConfigs) != 1 {
				t.Fatalf("%s: want one job discovering pods", f)
			}
			checkK8sPods(t, f, c)
			continue
		}
		var names []string
		for _, sc := range c.ScrapeConfigs {
			names = append(names, sc.JobName)
			if len(sc.StaticConfigs) == 0 {
				t.Errorf("%s: job %s has no static targets", f, sc.JobName)
			}
			secure := f == "prometheus-secure.yml" || f == "prometheus-token.yml"
			if secure && (sc.Scheme != "https" || sc.TLSConfig.CertFile == "" && sc.Authorization.CredentialsFile == "") {
				t.Errorf("%s: job %s: scheme %q without an admin certificate or token; /metrics refuses that with TLS", f, sc.JobName, sc.Scheme)
			}
		}
		if !slices.Equal(names, jobs) {
			t.Errorf("%s: jobs %v, want %v", f, names, jobs)
		}
	}

	want := composeAdminAddrs(t)
	var got []string
	for _, sc := range readScrapeConfig(t, "prometheus.yml").ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			got = append(got, st.Targets...)
		}
	}
	sort.Strings(got)
	if !slices.Equal(got, want) {
		t.Errorf("prometheus.yml scrapes %v; the compose file's default services serve admin on %v", got, want)
	}
}

// checkK8sPods checks prometheus-k8s.yml against the pods deploy/k8s
// runs: the relabelling keeps exactly the master, agent and gateway pods,
// each on a container port named admin, and their name label is the job.
func checkK8sPods(t *testing.T, file string, c scrapeConfig) {
	t.Helper()
	keep := map[string]*regexp.Regexp{}
	for _, rc := range c.ScrapeConfigs[0].RelabelConfigs {
		if rc.Action == "keep" && len(rc.SourceLabels) == 1 {
			keep[rc.SourceLabels[0]] = regexp.MustCompile("^(?:" + rc.Regex + ")$")
		}
	}
	nameKeep, portKeep := keep["__meta_kubernetes_pod_label_app_kubernetes_io_name"], keep["__meta_kubernetes_pod_container_port_name"]
	if nameKeep == nil || portKeep == nil {
		t.Fatalf("%s: want keep rules on the pods' app.kubernetes.io/name and on the container port name", file)
	}
	manifests, err := filepath.Glob("../k8s/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var kept []string
	for _, m := range manifests {
		f, err := os.Open(m)
		if err != nil {
			t.Fatal(err)
		}
		dec := yaml.NewDecoder(f)
		for {
			var obj struct {
				Kind string `yaml:"kind"`
				Spec struct {
					Template struct {
						Metadata struct {
							Labels map[string]string `yaml:"labels"`
						} `yaml:"metadata"`
						Spec struct {
							Containers []struct {
								Ports []struct {
									Name string `yaml:"name"`
								} `yaml:"ports"`
							} `yaml:"containers"`
						} `yaml:"spec"`
					} `yaml:"template"`
				} `yaml:"spec"`
			}
			if err := dec.Decode(&obj); errors.Is(err, io.EOF) {
				break
			} else if err != nil {
				t.Fatalf("%s: %v", m, err)
			}
			switch obj.Kind {
			case "StatefulSet", "DaemonSet", "Deployment":
			default:
				continue
			}
			name := obj.Spec.Template.Metadata.Labels["app.kubernetes.io/name"]
			if !nameKeep.MatchString(name) {
				continue
			}
			kept = append(kept, name)
			admin := false
			for _, ct := range obj.Spec.Template.Spec.Containers {
				for _, p := range ct.Ports {
					admin = admin || portKeep.MatchString(p.Name)
				}
			}
			if !admin {
				t.Errorf("%s: %s pods have no container port %s keeps", m, name, portKeep)
			}
		}
		_ = f.Close()
	}
	sort.Strings(kept)
	want := slices.Sorted(slices.Values(jobs))
	if !slices.Equal(kept, want) {
		t.Errorf("%s keeps the pods of %v in deploy/k8s, want %v (their name label becomes the job)", file, kept, want)
	}
}

// composeAdminAddrs returns the --admin-addr of every service of the
// compose file's default profile.
func composeAdminAddrs(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../../docker-compose.yml")
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Services map[string]struct {
			Profiles []string `yaml:"profiles"`
			Command  []string `yaml:"command"`
		} `yaml:"services"`
	}
	if err := yaml.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	var addrs []string
	for _, s := range doc.Services {
		if len(s.Profiles) > 0 {
			continue
		}
		if i := slices.Index(s.Command, "--admin-addr"); i >= 0 && i+1 < len(s.Command) {
			addrs = append(addrs, s.Command[i+1])
		}
	}
	sort.Strings(addrs)
	if len(addrs) != 4 {
		t.Fatalf("admin addresses in docker-compose.yml: %v, want the master's, two agents' and the gateway's", addrs)
	}
	return addrs
}

// selector is one vector selector of a query: the metric it names, the
// job it is restricted to ("" for any), and its other matchers.
type selector struct {
	where    string
	metric   string
	job      string
	matchers []*labels.Matcher
}

// selectors parses every query and returns its vector selectors.
func selectors(t *testing.T, qs []query) []selector {
	t.Helper()
	var out []selector
	for _, q := range qs {
		expr, err := promql.ParseExpr(q.expr)
		if err != nil {
			t.Fatalf("%s: %v", q.where, err)
		}
		parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
			vs, ok := n.(*parser.VectorSelector)
			if !ok {
				return nil
			}
			s := selector{where: q.where}
			for _, m := range vs.LabelMatchers {
				switch {
				case m.Name == model.MetricNameLabel && m.Type == labels.MatchEqual:
					s.metric = m.Value
				case m.Name == model.MetricNameLabel:
					t.Errorf("%s: a metric name matched by regular expression (%s) cannot be checked", q.where, m)
				case m.Name == "job" && m.Type == labels.MatchEqual:
					s.job = m.Value
				case m.Name == "job" || m.Name == "instance":
					// Target labels, set by Prometheus.
				default:
					s.matchers = append(s.matchers, m)
				}
			}
			out = append(out, s)
			return nil
		})
	}
	return out
}

// ruleQueries returns every alert's expression.
func ruleQueries(t *testing.T) []query {
	t.Helper()
	var qs []query
	for _, r := range loadRules(t) {
		qs = append(qs, query{where: fmt.Sprintf("%s: alert %s", rulesFile, r.Alert), expr: r.Expr})
	}
	return qs
}

// syntheticMetrics are made by Prometheus itself, not exported by a process.
var syntheticMetrics = map[string]bool{"up": true, "scrape_duration_seconds": true, "scrape_samples_scraped": true, "ALERTS": true, "ALERTS_FOR_STATE": true}

// labelValues are the values a label can take that a healthy cluster
// exports no series of, derived from the code that makes them: a query may
// select on them although the scrape below never shows them.
func labelValues() map[string][]string {
	var health, lifecycle, reason []string
	for v := range masterv1.SegmentHealth_name {
		health = append(health, registry.HealthLabel(masterv1.SegmentHealth(v)))
	}
	for v := range masterv1.SegmentLifecycle_name {
		lifecycle = append(lifecycle, registry.LifecycleLabel(masterv1.SegmentLifecycle(v)))
	}
	for v := range masterv1.ErrorReason_name {
		reason = append(reason, rpcerr.ReasonName(masterv1.ErrorReason(v)))
	}
	return map[string][]string{"health": health, "lifecycle": lifecycle, "reason": reason}
}

// TestMetricsExist starts a real cluster (a master, two agents with memory
// and disk segments, the gateway, mTLS on every link), puts and gets an
// object and makes one refused read, scrapes every process's /metrics as
// Prometheus does with prometheus-secure.yml (HTTPS, the admin
// certificate), and checks every metric the alerts and the dashboard
// select: it must be exported by the job the query names, carry every
// label the query matches on, and, for an equality match, have a series
// with that value (or the value must be one the code makes, for series a
// healthy cluster has none of).
func TestMetricsExist(t *testing.T) {
	_, dqs := loadDashboard(t)
	sels := selectors(t, append(ruleQueries(t), dqs...))

	c := testcluster.Start(t, testcluster.Options{Gateway: true, AgentDisk: 4 << 20, TLS: true})
	admin := scrapeTLS(t, c)
	exercise(t, c, admin)
	targets := map[string][]string{
		"crescent-master":  {c.MasterAdminAddr()},
		"crescent-gateway": {c.Gateway().AdminAddr()},
	}
	for i := range c.Agents() {
		targets["crescent-agent"] = append(targets["crescent-agent"], c.Agent(i).AdminAddr())
	}
	exported := map[string]map[string][]map[string]string{} // job → series name → label sets
	for _, job := range jobs {
		exported[job] = map[string][]map[string]string{}
		for _, addr := range targets[job] {
			for name, ls := range scrape(t, addr, admin) {
				exported[job][name] = append(exported[job][name], ls...)
			}
		}
	}
	// Without a client certificate /metrics is refused: the secure scrape
	// configs must present one (or a token).
	noCert := admin.Clone()
	noCert.Certificates, noCert.GetClientCertificate = nil, nil
	if code := getStatus(t, c.MasterAdminAddr(), "/metrics", noCert); code != http.StatusUnauthorized && code != http.StatusForbidden {
		t.Errorf("GET /metrics without a client certificate: %d, want 401 or 403", code)
	}

	known := labelValues()
	checked := map[string]bool{}
	for _, s := range sels {
		if s.metric == "" {
			t.Errorf("%s: a selector without a metric name cannot be checked", s.where)
			continue
		}
		if syntheticMetrics[s.metric] {
			continue
		}
		inJobs := jobs
		if s.job != "" {
			if !slices.Contains(jobs, s.job) {
				t.Errorf("%s: job %q is not one of the scrape configs' %v", s.where, s.job, jobs)
				continue
			}
			inJobs = []string{s.job}
		}
		var series []map[string]string
		for _, job := range inJobs {
			series = append(series, exported[job][s.metric]...)
		}
		if len(series) == 0 {
			t.Errorf("%s: %s is not exported by %v", s.where, s.metric, inJobs)
			continue
		}
		checked[s.metric] = true
		for _, m := range s.matchers {
			has, matched := false, false
			for _, ls := range series {
				if v, ok := ls[m.Name]; ok {
					has = true
					matched = matched || m.Matches(v)
				}
			}
			switch {
			case !has:
				t.Errorf("%s: %s has no label %q", s.where, s.metric, m.Name)
			case m.Type == labels.MatchEqual && !matched && !slices.Contains(known[m.Name], m.Value):
				t.Errorf("%s: no series of %s has %s, and the code makes no such value", s.where, s.metric, m)
			}
		}
	}
	names := make([]string, 0, len(checked))
	for n := range checked {
		names = append(names, n)
	}
	sort.Strings(names)
	t.Logf("%d metrics the alerts and the dashboard use are exported: %s", len(names), strings.Join(names, " "))
}

// exercise makes the cluster export the labelled series a fresh one has
// none of: a put and a get (command batches, data bytes) and a read with a
// bad token (crescent_agent_data_errors_total).
func exercise(t *testing.T, c *testcluster.Cluster, admin *tls.Config) {
	t.Helper()
	ctx := t.Context()
	cl := c.Client(t)
	if err := cl.Put(ctx, "observability", []byte("scraped")); err != nil {
		t.Fatalf("Put: %v", err)
	}
	if _, err := cl.Get(ctx, "observability"); err != nil {
		t.Fatalf("Get: %v", err)
	}
	cc, err := grpc.NewClient(c.Agent(0).DataEndpoint(), grpc.WithTransportCredentials(credentials.NewTLS(admin)), rpccodec.DialOption())
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	st, err := agentv1.NewDataServiceClient(cc).Read(ctx, &agentv1.ReadRequest{SegmentId: "none", AllocationId: 1, Token: []byte("not a token"), Length: 1})
	if err == nil {
		_, err = st.Recv()
	}
	if err == nil {
		t.Fatal("a read with a bad token succeeded")
	}
	if got := rpcerr.Reason(err); got != "INVALID_TOKEN" {
		t.Fatalf("read with a bad token: %v (reason %q), want INVALID_TOKEN", err, got)
	}
}

// scrape fetches one /metrics page over HTTPS and returns its series names
// (a histogram's as Prometheus stores them: _bucket, _sum, _count) with
// their label sets.
func scrape(t *testing.T, addr string, tc *tls.Config) map[string][]map[string]string {
	t.Helper()
	resp, err := httpsClient(addr, tc).Get("https://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("scrape %s: %s: %s", addr, resp.Status, b)
	}
	tp := expfmt.NewTextParser(model.UTF8Validation)
	families, err := tp.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	out := map[string][]map[string]string{}
	for name, mf := range families {
		for _, m := range mf.GetMetric() {
			ls := map[string]string{}
			for _, lp := range m.GetLabel() {
				ls[lp.GetName()] = lp.GetValue()
			}
			switch mf.GetType() {
			case dto.MetricType_HISTOGRAM, dto.MetricType_GAUGE_HISTOGRAM:
				bucket := map[string]string{"le": ""}
				for k, v := range ls {
					bucket[k] = v
				}
				out[name+"_bucket"] = append(out[name+"_bucket"], bucket)
				out[name+"_sum"] = append(out[name+"_sum"], ls)
				out[name+"_count"] = append(out[name+"_count"], ls)
			case dto.MetricType_SUMMARY:
				out[name+"_sum"] = append(out[name+"_sum"], ls)
				out[name+"_count"] = append(out[name+"_count"], ls)
				out[name] = append(out[name], ls)
			default:
				out[name] = append(out[name], ls)
			}
		}
	}
	return out
}

// scrapeTLS is the TLS configuration of prometheus-secure.yml's
// tls_config, as Prometheus builds it (crypto/tls): the cluster's CA and the
// admin certificate.
func scrapeTLS(t *testing.T, c *testcluster.Cluster) *tls.Config {
	t.Helper()
	f := c.Files(auth.RoleAdmin, testcluster.Admin)
	pem, err := os.ReadFile(f.CA)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		t.Fatalf("no certificate in %s", f.CA)
	}
	cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
}

// httpsClient is a client of the server at addr (host:port), verified by
// its IP address as Prometheus verifies a static target.
func httpsClient(addr string, tc *tls.Config) *http.Client {
	tc = tc.Clone()
	tc.ServerName, _, _ = net.SplitHostPort(addr)
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: tc, DisableKeepAlives: true}}
}

func getStatus(t *testing.T, addr, path string, tc *tls.Config) int {
	t.Helper()
	resp, err := httpsClient(addr, tc).Get("https://" + addr + path)
	if err != nil {
		t.Fatalf("GET %s%s: %v", addr, path, err)
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}
