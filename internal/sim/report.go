package sim

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
)

// Result is what one run measured. Costs are over the measured span
// (Config.Measure, else the whole run); accuracy over the whole run.
type Result struct {
	Config Config
	// Seconds is the measured span's length.
	Seconds float64
	// Decisions counts every decision; Admitted those that passed;
	// FalseAllows and FalseDenies those the central counter decided the
	// other way.
	Decisions, Admitted, FalseAllows, FalseDenies int64
	// Windows is admitted / limit of every hot key's complete window
	// (every window, with an explicit trace), in increasing order;
	// InOrder holds the same in window order (by window, then key).
	Windows, InOrder []float64
	// Latencies are the milliseconds from a hot key's first denial in a
	// window, anywhere, to each other region's view of it at the limit, in
	// increasing order; Unreached counts the regions whose view never got
	// there in the run.
	Latencies []int64
	Unreached int
	// KeyLatencies are the same by key, in the order the views got
	// there.
	KeyLatencies map[string][]int64
	// KeyAdmitted are the units each hot key's windows admitted, by
	// region.
	KeyAdmitted map[string][]int64
	// Uncounted are units admitted that their region's Redis did not
	// count; Unpublished units a region counted in a cell it registered
	// that MySQL did not hold when the cell stopped weighing (hot keys).
	Uncounted, Unpublished int64
	// Regions are the regions' costs; Total their sum.
	Regions []RegionResult
	Total   RegionResult
	// ReadWaitTimeouts counts decisions that stopped waiting for a read
	// on the wall clock: the one thing that could make a run depend on
	// the machine (0 unless the machine stalled for the read timeout).
	ReadWaitTimeouts int64
	// GateTrips counts the times a node's write breaker opened.
	GateTrips int64
}

// RegionResult is one region's cost over the measured span.
type RegionResult struct {
	Name string
	// Requests and Admitted are the requests the region received and
	// those it admitted.
	Requests, Admitted int64
	Redis              simmodel.RedisCost
	MySQL              simmodel.MySQLCost
}

func (s *sim) result() *Result {
	c := s.cfg
	res := &Result{Config: c, Decisions: s.m.decisions, Admitted: s.m.allowed,
		FalseAllows: s.m.falseAllows, FalseDenies: s.m.falseDenies,
		Uncounted: s.m.uncounted, Unpublished: s.m.unpublished, Unreached: s.m.unreached()}
	from, to := s.base, s.end
	if c.Measure != (simmodel.Span{}) {
		from, to = s.base+c.Measure.From, s.base+c.Measure.To
	}
	res.Seconds = float64(to-from) / 1000
	w := c.Window.Milliseconds()
	res.InOrder = s.m.windows(s.base/w, s.end/w, c.Requests != nil)
	res.Windows = slices.Sorted(slices.Values(res.InOrder))
	res.Latencies = slices.Clone(s.m.latencies)
	res.KeyLatencies = s.m.keyLatencies
	res.KeyAdmitted = map[string][]int64{}
	for k, by := range s.m.keyAdmitted {
		res.KeyAdmitted[s.ks.name(k)] = by
	}
	slices.Sort(res.Latencies)
	res.Total.Name = "total"
	for i, r := range s.regions {
		rr := RegionResult{Name: r.name, Requests: r.requests, Admitted: r.admitted}
		rr.Redis = s.span[1].redis[i]
		rr.Redis.Sub(s.span[0].redis[i])
		rr.MySQL = s.span[1].mysql[i]
		rr.MySQL.Sub(s.span[0].mysql[i])
		res.Regions = append(res.Regions, rr)
		res.Total.Requests += rr.Requests
		res.Total.Admitted += rr.Admitted
		res.Total.Redis.Add(rr.Redis)
		res.Total.MySQL.Add(rr.MySQL)
	}
	for _, n := range s.nodes {
		res.ReadWaitTimeouts += n.eng.Stats().ReadWaitTimeouts
		res.GateTrips += n.gate.Tripped
	}
	return res
}

// WindowMax and WindowMedian are the largest and the median admitted /
// limit per window (0 when there was none).
func (r *Result) WindowMax() float64 {
	if len(r.Windows) == 0 {
		return 0
	}
	return r.Windows[len(r.Windows)-1]
}

// WindowMedian: see WindowMax.
func (r *Result) WindowMedian() float64 {
	if len(r.Windows) == 0 {
		return 0
	}
	return r.Windows[len(r.Windows)/2]
}

// Burst returns the 50th and 99th percentiles of Latencies (-1 when
// none).
func (r *Result) Burst() (p50, p99 time.Duration) {
	return time.Duration(percentile(r.Latencies, 0.5)) * time.Millisecond,
		time.Duration(percentile(r.Latencies, 0.99)) * time.Millisecond
}

// PerSecond is n over the measured span.
func (r *Result) PerSecond(n int64) float64 { return float64(n) / r.Seconds }

// RedisPerRequest is a region's Redis calls per request it received.
func (rr *RegionResult) RedisPerRequest() float64 {
	if rr.Requests == 0 {
		return 0
	}
	return float64(rr.Redis.Calls) / float64(rr.Requests)
}

// RedisSplit is RedisPerRequest in two parts: the request path's calls
// (reads, reservations) and the others (replay, the role, the run ID
// check), which follow the nodes and the ticks more than the requests.
func (rr *RegionResult) RedisSplit() (path, rest float64) {
	if rr.Requests == 0 {
		return 0, 0
	}
	p := rr.Redis.Reads + rr.Redis.Reserves
	return float64(p) / float64(rr.Requests), float64(rr.Redis.Calls-p) / float64(rr.Requests)
}

func pct(n, of int64) string {
	if of == 0 {
		return "–"
	}
	return fmt.Sprintf("%.3f %%", 100*float64(n)/float64(of))
}

func ms(d time.Duration) string {
	if d < 0 {
		return "–"
	}
	if d < time.Second {
		return fmt.Sprintf("%d ms", d.Milliseconds())
	}
	return fmt.Sprintf("%.2f s", d.Seconds())
}

// BurstText is the burst column: p50 / p99, and the regions never
// reached.
func (r *Result) BurstText() string {
	if len(r.Latencies) == 0 && r.Unreached == 0 {
		return "–"
	}
	p50, p99 := r.Burst()
	t := ms(p50) + " / " + ms(p99)
	if r.Unreached > 0 {
		t += fmt.Sprintf(" (%d never)", r.Unreached)
	}
	return t
}

// Describe is the run's configuration in one paragraph.
func (r *Result) Describe() string {
	c := r.Config
	var b strings.Builder
	load := c.Load
	if c.Scenario == Abuse {
		load *= 10
	}
	fmt.Fprintf(&b, "scenario %s, %d regions × %d nodes, %d keys (%d hot at %g × the limit's rate; background %g req/s), limit %d per %s, %s simulated, seed %d\n",
		c.Scenario, c.Regions, c.Nodes, c.Keys, max(c.Hot, 0), load, max(c.Background, 0), c.Limit, c.Window, c.Duration, c.Seed)
	if c.Requests != nil {
		b.Reset()
		fmt.Fprintf(&b, "explicit trace of %d requests, %d regions × %d nodes, limit %d per %s, %s simulated, seed %d\n",
			len(c.Requests), c.Regions, c.Nodes, c.Limit, c.Window, c.Duration, c.Seed)
	}
	replicas := fmt.Sprintf("replica lag %s (median)", c.ReplicaLag)
	if c.NoReplicas {
		replicas = "no replicas"
	}
	trips := fmt.Sprintf("round trip to the primary %.0f ms, in its own region", rtt(0, c.Regions, c.LocalRTT, c.CrossRTT))
	if c.Regions > 1 {
		lo, hi := rtt(1, c.Regions, c.LocalRTT, c.CrossRTT), 0.0
		for i := 1; i < c.Regions; i++ {
			x := rtt(i, c.Regions, c.LocalRTT, c.CrossRTT)
			lo, hi = min(lo, x), max(hi, x)
		}
		trips = fmt.Sprintf("round trip to the primary %.0f–%.0f ms from the other regions", lo, hi)
	}
	fmt.Fprintf(&b, "mysql_flush %s, global_sync %s, blocklist_sync %s, publish_floor %g, min_window %s; %s, %s",
		c.Flush, c.GlobalSync, c.BlocklistSync, c.PublishFloor, c.MinWindow, trips, replicas)
	if c.Window < c.MinWindow {
		fmt.Fprintf(&b, "\nthe window (%s) is shorter than min_window: each region counts alone", c.Window)
	}
	return b.String()
}

// Print writes the run's tables: accuracy, then cost per region and in
// total.
func (r *Result) Print(w io.Writer) {
	fmt.Fprintln(w, r.Describe())
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| admitted / limit per window: max | median | false allows | false denies | first denial → its count in every region: p50 / p99 | units uncounted / unpublished |")
	fmt.Fprintln(w, "| ---: | ---: | ---: | ---: | ---: | ---: |")
	// A run without hot keys (-hot -1) measures no window: its max and
	// median were printed 0.000, as if nothing had been admitted.
	wmax, wmed := "–", "–"
	if len(r.Windows) > 0 {
		wmax, wmed = fmt.Sprintf("%.3f", r.WindowMax()), fmt.Sprintf("%.3f", r.WindowMedian())
	}
	fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %d / %d |\n\n", wmax, wmed,
		pct(r.FalseAllows, r.Decisions), pct(r.FalseDenies, r.Decisions), r.BurstText(), r.Uncounted, r.Unpublished)
	fmt.Fprintln(w, "| region | requests/s | Redis calls/request (request path + replay, role, INFO) | Redis calls/s | MySQL statements/s (primary + replica) | rows read/s (primary + replica) | rows written/s |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
	for _, rr := range append(slices.Clone(r.Regions), r.Total) {
		m := rr.MySQL
		path, rest := rr.RedisSplit()
		fmt.Fprintf(w, "| %s | %.1f | %.2f + %.2f | %.0f | %.1f + %.1f | %.1f + %.1f | %.1f |\n", rr.Name, r.PerSecond(rr.Requests),
			path, rest, r.PerSecond(rr.Redis.Calls),
			r.PerSecond(m.Statements), r.PerSecond(m.ReplicaStatements), r.PerSecond(m.RowsRead), r.PerSecond(m.ReplicaRowsRead),
			r.PerSecond(m.RowsWritten))
	}
	if r.ReadWaitTimeouts > 0 {
		fmt.Fprintf(w, "\nwarning: %d decisions gave up waiting for a read on the wall clock: this run may not repeat exactly\n", r.ReadWaitTimeouts)
	}
}
