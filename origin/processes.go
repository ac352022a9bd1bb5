package origin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The region's processes. Processes that meet a key at the same moment
// each read it before deciding, and each read registers its process in the
// key's cell, so the first to read finds none of the others there, the
// second one, and so on: until they hear from the origin again, the early
// readers count too few processes near the limit and decide alone what
// the others decide too (four Caddy processes took a median of 156 of a
// limit of 100 in a burst). So each process also records itself in one
// sorted set of the region, every WatchProcesses interval, scored by when
// its record lapses, and the same call counts the live records: the engine
// counts that many processes in a young cell (engine.SetProcesses).
//
//	<prefix>:{processes}   node ID → Unix ms its record lapses
//
// on the endpoint of the role (roleEndpoint). Times are Redis's own
// (TIME), so the nodes' clocks play no part: a node whose clock ran ahead
// would otherwise drop every other record on each renewal, and one whose
// clock ran behind would never be counted. A record lapses processesLapse
// intervals after its last renewal, so a process that stops (or restarts
// under a new ID) is counted for that long, unless it leaves as it exits
// (Leave): a node restarted in a deploy is then counted once, not twice
// for those seconds.

// processesLapse is how many intervals a record outlives its renewal: a
// renewal that a slow Redis delays does not drop the process.
const processesLapse = 5

// settleIntervals is how long after a gap in its renewals a process
// counts at least the processes it counted before the gap: every process
// renews once an interval, so two see every one of them back.
const settleIntervals = 2

// processesScript renews ARGV[1]'s record until ARGV[2] ms from Redis's
// clock, drops the records that lapsed, and returns how many are live.
// The set's expiry only ever grows: a process renewing with a shorter
// lapse (another build's) must not take the others' records with the set
// before theirs lapse (a heartbeat with a lapse of 1 ms dropped every
// record a millisecond later).
// Reading the clock makes the script's effects what a replica replays
// (the only way since Redis 7; asked for before).
var processesScript = redis.NewScript(`
if redis.replicate_commands then pcall(redis.replicate_commands) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lapse = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], string.format('%d', now + lapse), ARGV[1])
if redis.call('PTTL', KEYS[1]) < lapse then redis.call('PEXPIRE', KEYS[1], lapse) end
return {redis.call('ZCARD', KEYS[1]), now}
`)

// The region's clock. Windows are aligned to the Unix epoch, so the
// processes of a region count in the same cells only while their clocks
// agree; a process whose NTP failed counts in a window of its own for as
// long as its clock is off (see engine.SetClockOffset). Redis's clock is
// the one every process of the region reaches, so each heartbeat also
// measures it: Redis's time, less the midpoint of the call on this
// process's clock, is the offset the engine adds to its clock.

// clockSampleMaxRTT is the slowest heartbeat whose reading of Redis's
// clock is used: the midpoint of a call is off Redis's moment by at most
// half its round trip.
const clockSampleMaxRTT = 100 * time.Millisecond

// clockDeadband is how far a new measurement must be from the offset in
// use to replace it: a healthy fleet's clocks (a few ms apart under NTP)
// keep offset 0, and measurements that differ by a round trip's jitter do
// not step the engine's clock back and forth. Every step of the offset is
// a clock step to the engine.
const clockDeadband = 50 * time.Millisecond

// observeClock records a heartbeat's reading of Redis's clock (Unix ms)
// made between sent and recv on this process's clock.
//
// A slower reading is used only while no offset is known, and only when
// it shows the clocks apart by more than it can be wrong (half its round
// trip) and the deadband: a node's first heartbeat is slow in a busy
// start (the dial is in it), and discarding it left a node whose clock
// was 5 s ahead on its own clock for a second more, counting the keys it
// met meanwhile in the next window, where they stayed (an audit: 134 of
// a limit of 100 in the region's window). Its offset is off by at most
// half the round trip, and the next good reading replaces it when
// further than the deadband.
func (r *Redis) observeClock(redisMs int64, sent, recv time.Time) {
	rtt := recv.Sub(sent)
	if rtt < 0 {
		return
	}
	d := time.UnixMilli(redisMs).Sub(sent.Add(rtt / 2)).Round(time.Millisecond)
	if rtt > clockSampleMaxRTT && (r.clockKnown.Load() || d.Abs() <= rtt/2+clockDeadband) {
		return
	}
	if old := time.Duration(r.clockOffset.Load()); r.clockKnown.Load() && (d-old).Abs() <= clockDeadband {
		return
	}
	if !r.clockKnown.Load() && d.Abs() <= clockDeadband {
		d = 0
	}
	r.clockOffset.Store(int64(d))
	r.clockKnown.Store(true)
}

// ClockOffset is Redis's clock less this process's (Options.Now), as the
// heartbeats measured it, within clockDeadband; ok is false until one
// did. Give it to engine.SetClockOffset.
func (r *Redis) ClockOffset() (d time.Duration, ok bool) {
	return time.Duration(r.clockOffset.Load()), r.clockKnown.Load()
}

func (r *Redis) processesKey() string { return r.prefix + ":{processes}" }

// The region's builds. A rolling deploy runs two builds in a region for a
// while, and one that lingers (a node the deploy missed) runs beside the
// others for good, with whatever they changed since. So each record names
// its process's build as well: its member is the node ID, a space and the
// build (Options.Build), and Builds counts the live records by build. A
// record of a build that names none (before 2026-11-28) is its node ID
// alone, and counts under "".

// member is this process's record in the region's set.
func (r *Redis) member() string {
	if r.opts.Build == "" {
		return r.nodeID
	}
	return r.nodeID + " " + r.opts.Build
}

// Builds counts the region's live processes by the build their records
// name ("" for one that names none), as read now (one ZRANGE), and keeps
// the count for Stats. A lapsed record is dropped by the next heartbeat
// of any node: within a second.
func (r *Redis) Builds(ctx context.Context) (map[string]int64, error) {
	members, err := r.roleEndpoint().client.ZRange(ctx, r.processesKey(), 0, -1).Result()
	if err != nil {
		return nil, err
	}
	out := make(map[string]int64, 2)
	for _, m := range members {
		_, build, _ := strings.Cut(m, " ")
		out[build]++
	}
	r.builds.Store(&out)
	return out, nil
}

// Heartbeat records this process in the region's set until lapse from now
// (Redis's clock), drops the records that lapsed, and returns how many are
// live, this process's included. It measures Redis's clock too
// (ClockOffset).
func (r *Redis) Heartbeat(ctx context.Context, lapse time.Duration) (int64, error) {
	r.beat.Lock()
	defer r.beat.Unlock()
	if r.left {
		return 0, ErrLeft
	}
	k := r.processesKey()
	sent := r.opts.Now()
	res, err := processesScript.Run(ctx, r.roleEndpoint().client, []string{k}, r.member(), lapse.Milliseconds()).Int64Slice()
	if err != nil {
		return 0, explainScripts(err)
	}
	if len(res) != 2 {
		return 0, fmt.Errorf("heartbeat: %d values in the reply, want 2", len(res))
	}
	n := res[0]
	r.observeClock(res[1], sent, r.opts.Now())
	r.processes.Store(n)
	return n, nil
}

// ErrLeft: Heartbeat after Leave.
var ErrLeft = errors.New("this process left the region's processes")

// Leave takes this process's record out of the region's processes at
// once, and no heartbeat renews it again: call it when the process exits
// (not on a config reload, whose next origin goes on under the same node
// ID). A renewal under way ends first, so it cannot record the process
// again after it left. Failing, the record lapses as a stopped process's
// does.
func (r *Redis) Leave(ctx context.Context) error {
	r.beat.Lock()
	defer r.beat.Unlock()
	r.left = true
	return r.roleEndpoint().client.ZRem(ctx, r.processesKey(), r.member()).Err()
}

// Processes returns the live processes the last Heartbeat counted, 0
// before one answered or once renewals have failed for as long as a record
// lasts.
func (r *Redis) Processes() int64 { return r.processes.Load() }

// TakeRegionFrom starts r, an origin of the same servers as prev that has
// not heard from them yet (a reload that changed something else), from
// what prev last heard of the region: its processes, their builds and
// Redis's clock. Until its first heartbeat answered, r said 0 processes
// and no builds, and the engine counted none in a young cell: in an
// audit, one scrape in ten during back-to-back reloads showed
// origin_processes 0, which an alert on it takes for a region without
// Redis. r's own heartbeats replace them.
func (r *Redis) TakeRegionFrom(prev *Redis) {
	if prev == nil || prev == r {
		return
	}
	if n := prev.processes.Load(); n > 0 {
		r.processes.CompareAndSwap(0, n)
	}
	if b := prev.builds.Load(); b != nil {
		r.builds.CompareAndSwap(nil, b)
	}
	if prev.clockKnown.Load() && !r.clockKnown.Load() {
		r.clockOffset.Store(prev.clockOffset.Load())
		r.clockKnown.Store(true)
	}
}

// WatchProcesses renews this process's record every interval until Close,
// the first time at once, and calls onCount, on the watching goroutine,
// with each count Redis returns. A failed renewal is skipped: the record
// outlives it, and the last count stands, until renewals have failed for
// as long as a record lasts: then the count is 0 (unknown) until one
// succeeds again, and onLost, if set, gets the last error, once a run of
// failures. For two intervals after a gap in its renewals a count is at
// least the one before the gap (settleIntervals). It stops with Close or
// Leave. Call it once, when the origin
// goes to work: Provision must not start goroutines.
func (r *Redis) WatchProcesses(interval time.Duration, onCount func(n int64), onLost func(error)) {
	if interval <= 0 || onCount == nil {
		return
	}
	lapse := processesLapse * interval
	go func() {
		t := time.NewTicker(interval)
		defer t.Stop()
		last, lost := time.Now(), false
		// After a gap in renewals the others' records may have lapsed on
		// Redis's clock, and the first renewals back count only those
		// that renewed before them: for settleIntervals a count is at
		// least the one before the gap (floor), until every process has
		// had its turn.
		var before, floor int64
		var settle time.Time
		for {
			ctx, cancel := context.WithTimeout(context.Background(), interval)
			n, err := r.Heartbeat(ctx, lapse)
			cancel()
			switch {
			case errors.Is(err, ErrLeft):
				return
			case err == nil:
				now := time.Now()
				if now.Sub(last) > 2*interval {
					floor, settle = before, now.Add(settleIntervals*interval)
				}
				if now.Before(settle) && n < floor {
					n = floor
					r.processes.Store(n)
				}
				last, lost, before = now, false, n
				onCount(n)
			case !lost && time.Since(last) >= lapse && !r.closed.Load():
				lost = true
				r.processes.Store(0)
				onCount(0)
				if onLost != nil {
					onLost(err)
				}
			}
			select {
			case <-r.done:
				return
			case <-t.C:
			}
		}
	}()
}
