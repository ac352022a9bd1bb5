package ratelimit

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
)

// dashboardFile is the Grafana dashboard shipped with the module.
const dashboardFile = "dashboards/ratelimit.json"

// dashboardScrapeTimeout bounds the wait for the first replay flush to Redis
// (the slow tick is 100 ms; the machine may be busy).
const dashboardScrapeTimeout = 20 * time.Second

// dashboard is the part of Grafana's dashboard model that holds queries:
// panels (rows nest theirs when collapsed) and template variables.
type dashboard struct {
	Panels     []dashboardPanel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type dashboardPanel struct {
	Title   string           `json:"title"`
	Type    string           `json:"type"`
	Panels  []dashboardPanel `json:"panels"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
}

// dashboardQuery is one PromQL expression and where the dashboard uses it.
type dashboardQuery struct{ where, expr string }

// loadDashboardQueries reads the dashboard and returns every PromQL
// expression in it: panel targets and the metrics of label_values()
// template variables.
func loadDashboardQueries(t *testing.T) []dashboardQuery {
	t.Helper()
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	var qs []dashboardQuery
	var walk func([]dashboardPanel)
	walk = func(ps []dashboardPanel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				if strings.TrimSpace(tg.Expr) == "" {
					t.Errorf("panel %q has a target without an expression", p.Title)
					continue
				}
				qs = append(qs, dashboardQuery{"panel " + p.Title, tg.Expr})
			}
			if p.Type != "row" && len(p.Targets) == 0 {
				t.Errorf("panel %q queries nothing", p.Title)
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	labelValues := regexp.MustCompile(`label_values\(\s*([^,)]+)`)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		// Grafana stores the query as a string or as {"query": "..."}.
		var s string
		if json.Unmarshal(v.Query, &s) != nil {
			var o struct{ Query string }
			if err := json.Unmarshal(v.Query, &o); err != nil {
				t.Fatalf("variable %s: query %s: %v", v.Name, v.Query, err)
			}
			s = o.Query
		}
		m := labelValues.FindStringSubmatch(s)
		if m == nil {
			t.Fatalf("variable %s: query %q is not label_values(<metric>, <label>)", v.Name, s)
		}
		qs = append(qs, dashboardQuery{"variable " + v.Name, m[1]})
	}
	return qs
}

// promqlWords are PromQL words that are not metric names when they are not
// followed by a parenthesis: keywords, and aggregation operators written
// before their grouping clause (`max by (x) (…)`).
var promqlWords = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true,
	"group_left": true, "group_right": true, "bool": true, "and": true,
	"or": true, "unless": true, "offset": true, "inf": true, "nan": true,
	"sum": true, "min": true, "max": true, "avg": true, "group": true,
	"stddev": true, "stdvar": true, "count": true, "count_values": true,
	"bottomk": true, "topk": true, "quantile": true, "limitk": true,
	"limit_ratio": true,
}

// groupingWords take a parenthesised list of label names, not an
// expression.
var groupingWords = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true,
	"group_left": true, "group_right": true,
}

// promqlMetricNames returns the metric names an expression selects, in
// order. It skips strings, label matchers ({…}), ranges ([…]), Grafana
// variables ($…), numbers, function names (a word before "("), grouping
// label lists and keywords: what remains of the words are metric names.
func promqlMetricNames(expr string) ([]string, error) {
	isStart := func(c byte) bool { return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
	isPart := func(c byte) bool { return isStart(c) || c >= '0' && c <= '9' }
	// skipTo returns the index after the close that matches the opener at
	// i, stepping over quoted strings.
	skipTo := func(i int, open, close byte) (int, error) {
		depth := 0
		for j := i; j < len(expr); j++ {
			switch c := expr[j]; c {
			case '"', '\'', '`':
				k := j + 1
				for ; k < len(expr) && expr[k] != c; k++ {
					if expr[k] == '\\' && c != '`' {
						k++
					}
				}
				j = k
			case open:
				depth++
			case close:
				if depth--; depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, fmt.Errorf("unbalanced %c at offset %d in %q", open, i, expr)
	}
	var names []string
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == '"' || c == '\'' || c == '`':
			k := i + 1
			for ; k < len(expr) && expr[k] != c; k++ {
				if expr[k] == '\\' && c != '`' {
					k++
				}
			}
			if k >= len(expr) {
				return nil, fmt.Errorf("unterminated string at offset %d in %q", i, expr)
			}
			i = k + 1
		case c == '{' || c == '[':
			close := byte('}')
			if c == '[' {
				close = ']'
			}
			j, err := skipTo(i, c, close)
			if err != nil {
				return nil, err
			}
			i = j
		case c == '$':
			i++
			for i < len(expr) && isPart(expr[i]) {
				i++
			}
		case c >= '0' && c <= '9' || c == '.':
			for i < len(expr) && (isPart(expr[i]) || expr[i] == '.' ||
				(expr[i] == '-' || expr[i] == '+') && (expr[i-1] == 'e' || expr[i-1] == 'E')) {
				i++
			}
		case isStart(c):
			j := i
			for j < len(expr) && isPart(expr[j]) {
				j++
			}
			word := expr[i:j]
			k := j
			for k < len(expr) && (expr[k] == ' ' || expr[k] == '\t' || expr[k] == '\n') {
				k++
			}
			switch lw := strings.ToLower(word); {
			case groupingWords[lw] && k < len(expr) && expr[k] == '(':
				end, err := skipTo(k, '(', ')')
				if err != nil {
					return nil, err
				}
				j = end
			case k < len(expr) && expr[k] == '(': // a function
			case promqlWords[lw]:
			default:
				names = append(names, word)
			}
			i = j
		default:
			i++
		}
	}
	return names, nil
}

func TestDashboard_MetricNamesOfAQuery(t *testing.T) {
	for _, c := range []struct {
		expr string
		want []string
	}{
		{`caddy_ratelimit_entries`, []string{"caddy_ratelimit_entries"}},
		{`sum by (result) (rate(caddy_ratelimit_decisions_total{instance=~"$instance", result=~"a|b"}[$__rate_interval]))`,
			[]string{"caddy_ratelimit_decisions_total"}},
		{`histogram_quantile(0.99, sum by (le, op) (rate(x_bucket{outcome="ok"}[5m])))`, []string{"x_bucket"}},
		{`max by (endpoint, state) (b{s="}"}) == 1`, []string{"b"}},
		{`time() - max by (instance) (last_ts > 0)`, []string{"last_ts"}},
		{`sum(rate(a[1m])) by (zone) / on (zone) group_left (x) sum(c) * 1e-3`, []string{"a", "c"}},
		{`a offset 5m and bool b unless count(c)`, []string{"a", "b", "c"}},
		{`rate(caddy:recorded:rule[5m])`, []string{"caddy:recorded:rule"}},
	} {
		got, err := promqlMetricNames(c.expr)
		if err != nil {
			t.Errorf("%s: %v", c.expr, err)
			continue
		}
		if !slices.Equal(got, c.want) {
			t.Errorf("%s: %q, want %q", c.expr, got, c.want)
		}
	}
	for _, bad := range []string{`a{x="1"`, `rate(a[5m)`, `a{x="unterminated}`} {
		if _, err := promqlMetricNames(bad); err == nil {
			t.Errorf("%s: no error for a malformed expression", bad)
		}
	}
}

// propagationMetricPrefix starts the cross-region layer's metrics.
const propagationMetricPrefix = "caddy_ratelimit_propagation_"

// splitQueries parts qs into those that select no metric starting with
// prefix and those that do.
func splitQueries(qs []dashboardQuery, prefix string) (without, with []dashboardQuery) {
	for _, q := range qs {
		if strings.Contains(q.expr, prefix) {
			with = append(with, q)
		} else {
			without = append(without, q)
		}
	}
	return without, with
}

// missingMetrics lists, per query, the metric names no scraped series has.
func missingMetrics(qs []dashboardQuery, scraped map[string]bool) ([]string, error) {
	var missing []string
	for _, q := range qs {
		names, err := promqlMetricNames(q.expr)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", q.where, err)
		}
		if len(names) == 0 {
			return nil, fmt.Errorf("%s: %q selects no metric", q.where, q.expr)
		}
		for _, n := range names {
			if !scraped[n] {
				missing = append(missing, fmt.Sprintf("%s: %s", q.where, n))
			}
		}
	}
	return missing, nil
}

// TestDashboard_EveryQueriedMetricExists runs Caddy with the module against
// a private Redis, sends traffic that is allowed and denied, waits for a
// replay flush, scrapes the admin endpoint's /metrics, and fails for every
// metric a dashboard query selects that the scrape does not have.
func TestDashboard_EveryQueriedMetricExists(t *testing.T) {
	qs := loadDashboardQueries(t)
	// The dashboard covers what operators asked for: decisions by result,
	// decision latency, Redis calls and breakers, the replay backlog.
	all := ""
	for _, q := range qs {
		all += q.expr + "\n"
	}
	for _, want := range []string{
		"caddy_ratelimit_decisions_total", "caddy_ratelimit_decision_duration_seconds_bucket",
		"caddy_ratelimit_origin_calls_total", "caddy_ratelimit_origin_breaker_state",
		"caddy_ratelimit_replay_pending_cells",
	} {
		if !strings.Contains(all, want) {
			t.Errorf("the dashboard does not query %s", want)
		}
	}

	srv := redistest.Start(t)
	t.Setenv("RATELIMIT_TEST_DASHBOARD_REDIS", srv.URL())
	tester, admin, base := startCaddy(t, func(admin, port int) string {
		return caddyConfig(admin, port, `	ratelimit {
		redis {env.RATELIMIT_TEST_DASHBOARD_REDIS}
		prefix dashboard
	}`, `
	handle {
		ratelimit {
			zone dash {
				key    {http.request.header.X-Key}
				limit  2
				window 1m
			}
		}
		respond "ok"
	}`)
	})
	for i, want := range []int{200, 200, 429} {
		if r := get(t, tester, base+"/", "X-Key", "dash-key"); r.status != want {
			t.Fatalf("request %d: status %d, want %d", i+1, r.status, want)
		}
	}
	// The admitted units reach Redis on a replay tick; wait for it so the
	// replay and flush series have values, not just names.
	var m map[string]float64
	deadline := time.Now().Add(dashboardScrapeTimeout)
	for {
		m = scrape(t, admin)
		if m[`caddy_ratelimit_replay_batches_total{outcome="ok"}`] >= 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no successful replay batch within %v", dashboardScrapeTimeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
	scraped := map[string]bool{}
	for series := range m {
		name, _, _ := strings.Cut(series, "{")
		scraped[name] = true
	}

	// The cross-region panels are checked against the scrape of Caddy with
	// MySQL (TestCaddy_MySQLLayer): a process keeps the first region it
	// wrote rows as, so the package's MySQL tests share one config.
	regional, crossRegion := splitQueries(qs, propagationMetricPrefix)
	if len(crossRegion) == 0 {
		t.Error("the dashboard has no cross-region panel")
	}
	missing, err := missingMetrics(regional, scraped)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range missing {
		t.Errorf("the dashboard queries a metric the scrape does not have: %s", s)
	}
	// The check can fail: a misspelt metric is reported.
	bad := append(slices.Clone(regional), dashboardQuery{"panel typo", `rate(caddy_ratelimit_decision_total[5m])`})
	if missing, err := missingMetrics(bad, scraped); err != nil || len(missing) != 1 {
		t.Fatalf("a misspelt metric gave %q, %v; want it reported alone", missing, err)
	}
	var unused []string
	for name := range scraped {
		if strings.HasPrefix(name, "caddy_ratelimit_") && !strings.Contains(all, strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_sum"), "_count")) {
			unused = append(unused, name)
		}
	}
	slices.Sort(unused)
	t.Logf("%d queries; module metrics not on the dashboard: %v", len(qs), unused)
}
