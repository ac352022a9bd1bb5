package ratelimit

import (
	"bufio"
	"bytes"
	"fmt"
	"math/rand/v2"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// fakeEndpoints are closed endpoints of the given addresses.
func fakeEndpoints(addrs ...string) origin.Stats {
	var s origin.Stats
	for _, a := range addrs {
		s.Endpoints = append(s.Endpoints, origin.EndpointStats{Address: a, Kind: origin.KindStandalone, Breaker: origin.BreakerClosed})
	}
	return s
}

// scrape reads the admin endpoint's /metrics into series → value; a
// series is written as the exposition format writes it, e.g.
// `caddy_ratelimit_decisions_total{result="allowed",zone="z"}`.
func scrape(t *testing.T, admin int) map[string]float64 {
	t.Helper()
	r := adminDo(t, admin, "GET", "/metrics")
	if r.status != 200 {
		t.Fatalf("GET /metrics: %d %s", r.status, r.body)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(bytes.NewReader(r.body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("metrics line %q: %v", line, err)
		}
		out[line[:i]] = v
	}
	return out
}

func decisionSeries(zone, result string) string {
	return `caddy_ratelimit_decisions_total{result="` + result + `",zone="` + zone + `"}`
}

const metricsRoutes = `
	handle /one {
		ratelimit {
			zone met_one {
				key    {http.request.header.X-Key}
				limit  2
				window 1m
			}
			on_missing_key skip
		}
		respond "one"
	}
	handle /two {
		ratelimit {
			zone met_tight {
				key    {http.request.header.X-Key}
				limit  1
				window 1m
			}
			zone met_wide {
				key    {http.request.header.X-Key}
				limit  10
				window 1h
			}
		}
		respond "two"
	}
	handle /dry {
		ratelimit {
			zone met_dry {
				key    {http.request.header.X-Key}
				limit  1
				window 1m
			}
			dry_run
		}
		respond "dry"
	}
	handle /cost {
		ratelimit {
			zone met_cost {
				key    {http.request.header.X-Key}
				limit  100
				window 1m
				cost   {http.request.header.X-Cost} 3
			}
			on_missing_key deny
		}
		respond "cost"
	}
`

// metricsRoutesReloaded raises met_one's limit and drops the rest.
const metricsRoutesReloaded = `
	handle /one {
		ratelimit {
			zone met_one {
				key    {http.request.header.X-Key}
				limit  5
				window 1m
			}
		}
		respond "one again"
	}
`

// TestMetrics_ScrapeAfterTrafficAndReload sends traffic that produces every
// decision result, scrapes the admin endpoint's /metrics for the documented
// series and their values, reloads a changed config and scrapes again: the
// collectors are registered into the new config's registry and keep their
// counts.
func TestMetrics_ScrapeAfterTrafficAndReload(t *testing.T) {
	useClock(t, 15*time.Second)
	tester, admin, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, metricsRoutes) })
	before := scrape(t, admin)
	do := func(path string, want int, headers ...string) {
		t.Helper()
		if r := get(t, tester, base+path, headers...); r.status != want {
			t.Fatalf("%s %v: %d, want %d", path, headers, r.status, want)
		}
	}
	do("/one", 200, "X-Key", "k")
	do("/one", 200, "X-Key", "k")
	do("/one", 429, "X-Key", "k")
	do("/one", 200) // no key: skipped
	do("/two", 200, "X-Key", "k")
	do("/two", 429, "X-Key", "k") // tight denies, wide is not charged
	do("/dry", 200, "X-Key", "k")
	do("/dry", 200, "X-Key", "k") // would have been denied
	do("/dry", 200, "X-Key", "k")
	do("/cost", 200, "X-Key", "k", "X-Cost", "lots") // charged the default cost
	do("/cost", 200, "X-Key", "k", "X-Cost", "4")
	do("/cost", 429) // no key: on_missing_key deny

	after := scrape(t, admin)
	delta := func(m map[string]float64, series string) float64 {
		t.Helper()
		v, ok := m[series]
		if !ok {
			t.Fatalf("series %s missing from /metrics", series)
		}
		return v - before[series]
	}
	for _, c := range []struct {
		series string
		want   float64
	}{
		{decisionSeries("met_one", "allowed"), 2},
		{decisionSeries("met_one", "denied"), 1},
		{decisionSeries("met_one", "skipped"), 1},
		{decisionSeries("met_tight", "allowed"), 1},
		{decisionSeries("met_tight", "denied"), 1},
		{decisionSeries("met_wide", "allowed"), 1},
		{decisionSeries("met_wide", "not_charged"), 1},
		{decisionSeries("met_wide", "denied"), 0},
		{decisionSeries("met_dry", "allowed"), 1},
		{decisionSeries("met_dry", "dry_run_denied"), 2},
		{decisionSeries("met_dry", "denied"), 0},
		{decisionSeries("met_cost", "allowed"), 2},
		{decisionSeries("met_cost", "missing_key"), 1},
		{`caddy_ratelimit_invalid_costs_total{zone="met_cost"}`, 1},
		{`caddy_ratelimit_invalid_costs_total{zone="met_one"}`, 0},
		// met_one k and met_tight k; a dry run records no denial.
		{"caddy_ratelimit_first_denials_total", 2},
	} {
		if got := delta(after, c.series); got != c.want {
			t.Errorf("%s: +%v, want +%v", c.series, got, c.want)
		}
	}
	// The engine's gauges: one key in each of five zones (a skipped zone and
	// a missing key count nothing), none strict (local-only), nothing to
	// replay.
	for series, want := range map[string]float64{
		"caddy_ratelimit_entries":                     5,
		"caddy_ratelimit_strict_keys":                 0,
		"caddy_ratelimit_replay_pending_cells":        0,
		"caddy_ratelimit_evictions_total":             0,
		"caddy_ratelimit_last_read_timestamp_seconds": 0,
	} {
		if got, ok := after[series]; !ok || got != want {
			t.Errorf("%s = %v (present %v), want %v", series, got, ok, want)
		}
	}
	// The latency histogram is sampled; its series exist from the start.
	for _, s := range []string{
		`caddy_ratelimit_decision_duration_seconds_bucket{result="allowed",le="1e-07"}`,
		`caddy_ratelimit_decision_duration_seconds_bucket{result="denied",le="0.001"}`,
		`caddy_ratelimit_decision_duration_seconds_count{result="allowed"}`,
	} {
		if _, ok := after[s]; !ok {
			t.Errorf("series %s missing", s)
		}
	}

	tester.InitServer(e2eConfig(admin, e2eListenPort(t, base), metricsRoutesReloaded), "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	reloaded := scrape(t, admin)
	if got := delta(reloaded, decisionSeries("met_one", "allowed")); got != 2 {
		t.Fatalf("after the reload, met_one allowed +%v, want +2 (the count must survive)", got)
	}
	if got := reloaded["caddy_ratelimit_entries"]; got != 5 {
		t.Fatalf("after the reload, entries = %v, want 5", got)
	}
	// The new limit is 5: k has used 2.
	do("/one", 200, "X-Key", "k")
	do("/one", 200, "X-Key", "k")
	do("/one", 200, "X-Key", "k")
	do("/one", 429, "X-Key", "k")
	final := scrape(t, admin)
	if got := delta(final, decisionSeries("met_one", "allowed")); got != 5 {
		t.Errorf("met_one allowed +%v after the reload's traffic, want +5", got)
	}
	if got := delta(final, decisionSeries("met_one", "denied")); got != 2 {
		t.Errorf("met_one denied +%v after the reload's traffic, want +2", got)
	}
}

// TestMetrics_AFailedReloadKeepsTheSeries: Caddy serves /metrics from the
// registry of the config it loaded last, and it makes that config's admin
// endpoint before it provisions the apps, so a reload that fails keeps the
// old config running behind the new config's /metrics. A reload that
// failed before any rate limit module was provisioned (here an unknown
// handler ahead of the limiter's) left that registry without the
// collectors: every caddy_ratelimit_ series vanished while the running
// config went on deciding requests.
func TestMetrics_AFailedReloadKeepsTheSeries(t *testing.T) {
	tester, admin, base := startCaddy(t, func(admin, port int) string { return e2eConfig(admin, port, metricsRoutes) })
	if r := get(t, tester, base+"/one", "X-Key", "failed-reload"); r.status != http.StatusOK {
		t.Fatalf("first request: %d", r.status)
	}
	before := scrape(t, admin)
	allowed := decisionSeries("met_one", "allowed")
	if _, ok := before[allowed]; !ok {
		t.Fatalf("%s missing before the reload", allowed)
	}
	bad := fmt.Sprintf(`{"admin": {"listen": "localhost:%d"},
 "apps": {"http": {"servers": {"s": {"listen": [":%d"], "routes": [
  {"handle": [{"handler": "no_such_handler"}]},
  {"handle": [{"handler": "ratelimit", "zones": [{"name": "met_one", "key": "{http.request.header.X-Key}", "limit": 2, "window": "1m"}]}]}]}}}}}`,
		admin, portOf(t, base))
	req, err := http.NewRequest(http.MethodPost, fmt.Sprintf("http://localhost:%d/load", admin), strings.NewReader(bad))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Close = true // a kept connection may reach an admin server a load replaced
	if status, _, body := roundTrip(t, http.DefaultClient, req); status < 400 || !strings.Contains(string(body), "no_such_handler") {
		t.Fatalf("the bad config answered %d %s, want its error", status, body)
	}
	if r := get(t, tester, base+"/one", "X-Key", "failed-reload"); r.status != http.StatusOK {
		t.Fatalf("after the failed reload the running config answered %d", r.status)
	}
	after := scrape(t, admin)
	if got, ok := after[allowed]; !ok || got != before[allowed]+1 {
		t.Errorf("after the failed reload %s = %v (present %v), want %v", allowed, got, ok, before[allowed]+1)
	}
	if got, ok := after["caddy_ratelimit_entries"]; !ok || got != before["caddy_ratelimit_entries"] {
		t.Errorf("after the failed reload caddy_ratelimit_entries = %v (present %v), want %v", got, ok, before["caddy_ratelimit_entries"])
	}
	// A config that does not use the limiter registers the collectors
	// too (its admin endpoint does), and serves none of their series.
	tester.InitServer(e2eConfig(admin, portOf(t, base), ""), "caddyfile")
	for series := range scrape(t, admin) {
		if strings.HasPrefix(series, "caddy_ratelimit_") {
			t.Errorf("with no config using the limiter /metrics serves %s", series)
		}
	}
}

// e2eListenPort is the port of base ("http://127.0.0.1:PORT").
func e2eListenPort(t *testing.T, base string) int {
	t.Helper()
	p, err := strconv.Atoi(base[strings.LastIndexByte(base, ':')+1:])
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestMetrics_RegisterTwiceIsSuccess: every handler of a config registers
// the same collectors into the config's registry.
func TestMetrics_RegisterTwiceIsSuccess(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	for range 2 {
		if err := registerMetrics(reg); err != nil {
			t.Fatal(err)
		}
	}
	// A pedantic registry checks what the collectors emit against what
	// they describe, with and without an engine in the pool.
	if _, err := reg.Gather(); err != nil {
		t.Fatalf("gather without an engine: %v", err)
	}
	useClock(t, 0)
	provisionTest(t, nil, &Handler{Zones: []*Zone{zoneOf("reg_twice", 1, time.Minute)}})
	st := lookupState()
	st.setOrigin(fakeView{stats: fakeEndpoints("redis://a:6379/0", "redis://b:6379/0")})
	t.Cleanup(func() { st.setOrigin(nil) })
	if _, err := reg.Gather(); err != nil {
		t.Fatalf("gather with an engine and an origin: %v", err)
	}
	// Two endpoints × two breakers × three states.
	if got := collectCount(redisCollector{}, "caddy_ratelimit_origin_breaker_state"); got != 12 {
		t.Fatalf("%d breaker state series for two endpoints, want 12", got)
	}
}

// TestHandler_DecisionLatencyIsSampled: about one decision in 32 is timed,
// and every one is counted.
func TestHandler_DecisionLatencyIsSampled(t *testing.T) {
	useClock(t, 0)
	serveOne := warmRequest(t, "off", 1) // one zone named "a"
	count := func() uint64 { return histogramCount(t, decisionAllowedSeconds) }
	allowedBefore := counterValue(t, decisionsTotal.WithLabelValues("a", resultAllowed))
	before := count()
	const n = 32 * 100
	for range n {
		serveOne()
	}
	// Binomial(3200, 1/32): mean 100, standard deviation 9.8.
	if got := count() - before; got < 40 || got > 200 {
		t.Fatalf("%d of %d decisions timed, want about %d", got, n, n/32)
	}
	if got := counterValue(t, decisionsTotal.WithLabelValues("a", resultAllowed)) - allowedBefore; got != n {
		t.Fatalf("%v decisions counted, want %d", got, n)
	}
}

func histogramCount(t *testing.T, o prometheus.Observer) uint64 {
	t.Helper()
	m, ok := o.(prometheus.Metric)
	if !ok {
		t.Fatalf("%T is not a metric", o)
	}
	return writeMetric(t, m).GetHistogram().GetSampleCount()
}

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	return writeMetric(t, c).GetCounter().GetValue()
}

func writeMetric(t *testing.T, m prometheus.Metric) *dto.Metric {
	t.Helper()
	var pb dto.Metric
	if err := m.Write(&pb); err != nil {
		t.Fatal(err)
	}
	return &pb
}

// collectCount is the number of series named name that c emits.
func collectCount(c prometheus.Collector, name string) int {
	ch := make(chan prometheus.Metric)
	go func() {
		c.Collect(ch)
		close(ch)
	}()
	n := 0
	for m := range ch {
		if strings.Contains(m.Desc().String(), `fqName: "`+name+`"`) {
			n++
		}
	}
	return n
}

// BenchmarkMetrics_PerRequest measures what metrics add to one request of
// one zone: the sampling draw, the sampled timing and the decision count,
// exactly as ServeHTTP does them, without the decision itself.
func BenchmarkMetrics_PerRequest(b *testing.B) {
	h := &Handler{Zones: []*Zone{zoneOf("bench_metrics", 1, time.Minute)}}
	h.compile()
	h.zones[0].metrics = newZoneMetrics("bench_metrics")
	decs := []engine.Decision{{Allowed: true}}
	zi := []int{0}
	b.ReportAllocs()
	for b.Loop() {
		var start time.Time
		timed := rand.Uint32()&latencySampleMask == 0
		if timed {
			start = time.Now()
		}
		if timed {
			observeDecision(true, time.Since(start))
		}
		h.countDecisions(decs, zi, true)
	}
}

// seriesValue returns the value of the series of c named name whose one
// label has the value label, or -1 when c sends none.
func seriesValue(t *testing.T, c prometheus.Collector, name, label string) float64 {
	t.Helper()
	ch := make(chan prometheus.Metric)
	go func() {
		c.Collect(ch)
		close(ch)
	}()
	v := -1.0
	for m := range ch {
		if !strings.Contains(m.Desc().String(), `fqName: "`+name+`"`) {
			continue
		}
		var pb dto.Metric
		if err := m.Write(&pb); err != nil {
			t.Fatal(err)
		}
		for _, l := range pb.GetLabel() {
			if l.GetValue() == label {
				v = pb.GetCounter().GetValue() + pb.GetGauge().GetValue()
			}
		}
	}
	return v
}

// TestMetrics_READMEListsEveryMetric: the README's metrics table, and the
// cross-region section's list, name every metric the module registers,
// and nothing it does not: two were missing from the table
// (resends_total, replay_lost_units_total).
func TestMetrics_READMEListsEveryMetric(t *testing.T) {
	readme, section := readmeSection(t, "Metrics")
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `([a-z_]+)` \\|").FindAllStringSubmatch(section, -1) {
		listed[m[1]] = true
	}
	// The cross-region layer's metrics are a list in its own section.
	_, cross, ok := strings.Cut(readme, "Metrics (prefix `caddy_ratelimit_`, no identifier label):")
	if !ok {
		t.Fatal("README has no list of the cross-region layer's metrics")
	}
	cross, _, _ = strings.Cut(cross, "Admin:")
	for _, m := range regexp.MustCompile("`(propagation_[a-z_]+)[`{]").FindAllStringSubmatch(cross, -1) {
		listed[m[1]] = true
	}
	registered := map[string]bool{}
	descs := make(chan *prometheus.Desc, 1024)
	for _, c := range collectors {
		c.Describe(descs)
	}
	close(descs)
	name := regexp.MustCompile(`fqName: "caddy_ratelimit_([a-z_]+)"`)
	for d := range descs {
		m := name.FindStringSubmatch(d.String())
		if m == nil {
			t.Fatalf("a collector's metric outside caddy_ratelimit_: %s", d)
		}
		registered[m[1]] = true
	}
	if len(registered) < 10 {
		t.Fatalf("found only %d registered metrics: %v", len(registered), registered)
	}
	for m := range registered {
		if !listed[m] {
			t.Errorf("caddy_ratelimit_%s is registered but not in the README's metrics table", m)
		}
	}
	for m := range listed {
		if !registered[m] {
			t.Errorf("the README's metrics table lists %s, which no collector registers", m)
		}
	}
}

// TestMetrics_ChargedAnywayIsItsOwnResult: a zone that Redis admitted and
// charged before another zone of the directive denied stays charged
// (engine.Decision.ChargedAnyway). It was counted not_charged, beside the
// zones a denial left uncharged, so the result hid units the region
// counted.
func TestMetrics_ChargedAnywayIsItsOwnResult(t *testing.T) {
	h := &Handler{Zones: []*Zone{zoneOf("met_ca_origin", 5, time.Minute), zoneOf("met_ca_local", 5, time.Minute), zoneOf("met_ca_deny", 5, time.Minute)}}
	h.compile()
	for i, z := range h.Zones {
		h.zones[i].metrics = newZoneMetrics(z.Name)
	}
	value := func(zone, result string) float64 {
		var pb dto.Metric
		if err := decisionsTotal.WithLabelValues(zone, result).Write(&pb); err != nil {
			t.Fatal(err)
		}
		return pb.GetCounter().GetValue()
	}
	before := map[string]float64{}
	results := []string{resultAllowed, resultDenied, resultNotCharged, resultChargedAnyway}
	for _, z := range h.Zones {
		for _, r := range results {
			before[z.Name+"/"+r] = value(z.Name, r)
		}
	}
	decs := []engine.Decision{{Allowed: true, ChargedAnyway: true}, {Allowed: true}, {Allowed: false}}
	h.countDecisions(decs, []int{0, 1, 2}, false)
	want := map[string]float64{
		"met_ca_origin/" + resultChargedAnyway: 1,
		"met_ca_local/" + resultNotCharged:     1,
		"met_ca_deny/" + resultDenied:          1,
	}
	for _, z := range h.Zones {
		for _, r := range results {
			s := z.Name + "/" + r
			if got := value(z.Name, r) - before[s]; got != want[s] {
				t.Errorf("%s: +%v, want +%v", s, got, want[s])
			}
		}
	}
}

// readmeMetric is one row of the README's metrics table.
type readmeMetric struct {
	typ    string
	labels []string
}

// readmeMetricsTable parses the README's metrics table: each row's name,
// type and label names (the backquoted names of the labels cell, outside
// the parentheses that list a label's values).
func readmeMetricsTable(t *testing.T) map[string]readmeMetric {
	t.Helper()
	_, section := readmeSection(t, "Metrics")
	row := regexp.MustCompile("(?m)^\\| `([a-z_]+)` \\| ([a-z]+) \\|([^|]*)\\|")
	values := regexp.MustCompile(`\([^)]*\)`)
	name := regexp.MustCompile("`([a-z_]+)`")
	out := map[string]readmeMetric{}
	for _, m := range row.FindAllStringSubmatch(section, -1) {
		var labels []string
		for _, l := range name.FindAllStringSubmatch(values.ReplaceAllString(m[3], ""), -1) {
			labels = append(labels, l[1])
		}
		slices.Sort(labels)
		out[m[1]] = readmeMetric{typ: m[2], labels: labels}
	}
	if len(out) < 30 {
		t.Fatalf("parsed %d rows of the README's metrics table: %v", len(out), out)
	}
	return out
}

// scrapeFamilies reads the admin endpoint's /metrics as metric families.
func scrapeFamilies(t *testing.T, admin int) map[string]*dto.MetricFamily {
	t.Helper()
	r := adminDo(t, admin, http.MethodGet, "/metrics")
	if r.status != http.StatusOK {
		t.Fatalf("GET /metrics: %d %s", r.status, r.body)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(r.body))
	if err != nil {
		t.Fatalf("parsing /metrics: %v", err)
	}
	return fams
}

// familyLabels are the label names of a family's series (a histogram's le
// excluded), each series' the same or the family is reported.
func familyLabels(t *testing.T, f *dto.MetricFamily) []string {
	t.Helper()
	var want []string
	for i, m := range f.GetMetric() {
		var got []string
		for _, l := range m.GetLabel() {
			got = append(got, l.GetName())
		}
		slices.Sort(got)
		if i == 0 {
			want = got
		} else if !slices.Equal(got, want) {
			t.Errorf("%s: series with labels %v and %v", f.GetName(), want, got)
		}
	}
	return want
}

// TestMetrics_READMETableMatchesTheScrape runs Caddy with the module on a
// private Redis, makes every metric of the README's table appear (traffic
// allowed and denied, a runtime override, a region reset, a Redis stopped
// and started again for the breakers), and checks each row's name, type and
// labels against what /metrics serves, and that /metrics serves no
// caddy_ratelimit_ family the table lacks (the cross-region layer's aside,
// listed in its own section).
func TestMetrics_READMETableMatchesTheScrape(t *testing.T) {
	table := readmeMetricsTable(t)
	srv := redistest.Start(t)
	t.Setenv("RATELIMIT_TEST_README_METRICS_REDIS", srv.URL())
	tester, admin, base := startCaddy(t, func(admin, port int) string {
		return caddyConfig(admin, port, `	ratelimit {
		redis {env.RATELIMIT_TEST_README_METRICS_REDIS}
		prefix readme_metrics
		breaker_timeout 100ms
	}`, `
	handle {
		ratelimit {
			zone readme_metrics {
				key    {http.request.header.X-Key}
				limit  2
				window 1m
				cost   {http.request.header.X-Cost} 1
			}
		}
		respond "ok"
	}`)
	})
	for i, want := range []int{200, 200, 429} {
		if r := get(t, tester, base+"/", "X-Key", "readme-key"); r.status != want {
			t.Fatalf("request %d: status %d, want %d", i+1, r.status, want)
		}
	}
	get(t, tester, base+"/", "X-Key", "readme-other", "X-Cost", "many")
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=readme_metrics&identifier=readme-key", `{"limit": 7}`).decode(t, http.StatusOK, new(overrideDoc))
	if r := adminDo(t, admin, http.MethodDelete, "/ratelimit/counters?zone=readme_metrics&identifier=readme-key&scope=region"); r.status != http.StatusOK {
		t.Fatalf("region reset: %d %s", r.status, r.body)
	}
	// A breaker transition: Redis stops, requests fail until the request
	// path's breaker opens.
	srv.Stop()
	redistest.Eventually(t, 10*time.Second, "a breaker transition", func() bool {
		get(t, tester, base+"/", "X-Key", "readme-cold-"+time.Now().String())
		_, ok := scrapeFamilies(t, admin)["caddy_ratelimit_origin_breaker_transitions_total"]
		return ok
	})
	srv.Restart()

	fams := scrapeFamilies(t, admin)
	for name, row := range table {
		f, ok := fams["caddy_ratelimit_"+name]
		if !ok {
			t.Errorf("the README lists %s, which /metrics does not serve", name)
			continue
		}
		if typ := strings.ToLower(f.GetType().String()); typ != row.typ {
			t.Errorf("%s: the README says %s, /metrics serves a %s", name, row.typ, typ)
		}
		if got := familyLabels(t, f); !slices.Equal(got, row.labels) {
			t.Errorf("%s: the README lists labels %v, /metrics serves %v", name, row.labels, got)
		}
	}
	for full := range fams {
		name, ok := strings.CutPrefix(full, "caddy_ratelimit_")
		if !ok || strings.HasPrefix(name, "propagation_") {
			continue
		}
		if _, ok := table[name]; !ok {
			t.Errorf("/metrics serves %s, which the README's table lacks", full)
		}
	}
}

// TestMetrics_AnOverrideThatLapsedIsNoLongerActive: overrides_active is
// what a node holds now, what it applies. An override that lapses
// applies no more on the request path, and the listing leaves it out;
// the gauge must drop it too, with no other change of overrides to
// make the node look again.
func TestMetrics_AnOverrideThatLapsedIsNoLongerActive(t *testing.T) {
	resetOverrides(t)
	clk := useClock(t, 15*time.Second)
	_, admin, _ := startCaddy(t, overrideConfig(""))
	const gauge = "caddy_ratelimit_overrides_active"
	exp := clk.Now().Add(10 * time.Second).UTC().Format(time.RFC3339Nano)
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=brief", `{"limit": 100, "expires": "`+exp+`"}`).
		decode(t, http.StatusOK, new(overrideDoc))
	adminSend(t, admin, http.MethodPut, "/ratelimit/overrides?zone=ov&identifier=kept", `{"limit": 100}`).
		decode(t, http.StatusOK, new(overrideDoc))
	if n := scrape(t, admin)[gauge]; n != 2 {
		t.Fatalf("%s is %v with two live overrides, want 2", gauge, n)
	}
	clk.Advance(11 * time.Second)
	if r := adminDo(t, admin, http.MethodGet, "/ratelimit/overrides?zone=ov&identifier=brief"); r.status != http.StatusNotFound {
		t.Fatalf("GET of the lapsed override: %d %s, want 404", r.status, r.body)
	}
	if n := scrape(t, admin)[gauge]; n != 1 {
		t.Fatalf("%s is %v after one of two overrides lapsed, want 1", gauge, n)
	}
}
