package origin

import (
	"context"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// The region's processes. Processes that meet a key at the same moment
// each read it before deciding, and each read registers its process in the
// key's cell, so the first to read finds none of the others there, the
// second one, and so on: until their first replays, the early readers
// count too few processes near the limit and decide alone what the others
// decide too (four Caddy processes took 130 of a limit of 100 in a burst).
// So each process also records itself in one sorted set of the region,
// every WatchProcesses interval, scored by when its record lapses, and the
// same call counts the live records: the engine counts that many processes
// in a cell it has not written yet (engine.SetProcesses).
//
//	<prefix>:{processes}   node ID → Unix ms its record lapses
//
// on the endpoint of the role (roleEndpoint).
//
// Times are the callers' clocks: a process whose clock runs ahead is
// counted a little longer, one whose clock runs behind by more than the
// lapse a little less. A record lapses processesLapse intervals after
// its last renewal, so a process that stops is counted for that long.

// processesLapse is how many intervals a record outlives its renewal: a
// renewal that a slow Redis delays does not drop the process.
const processesLapse = 5

var processesScript = redis.NewScript(`
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return redis.call('ZCARD', KEYS[1])
`)

func (r *Redis) processesKey() string { return r.prefix + ":{processes}" }

// Heartbeat records this process in the region's set until lapse from now,
// drops the records that lapsed, and returns how many are live, this
// process's included.
func (r *Redis) Heartbeat(ctx context.Context, lapse time.Duration) (int64, error) {
	k := r.processesKey()
	ep := r.roleEndpoint()
	now := time.Now().UnixMilli()
	n, err := processesScript.Run(ctx, ep.client, []string{k},
		now, strconv.FormatInt(now+lapse.Milliseconds(), 10), r.nodeID, lapse.Milliseconds()).Int64()
	if err != nil {
		return 0, err
	}
	r.processes.Store(n)
	return n, nil
}

// Processes returns the live processes the last Heartbeat counted, 0
// before one answered.
func (r *Redis) Processes() int64 { return r.processes.Load() }

// WatchProcesses renews this process's record every interval until Close,
// the first time at once, and calls onCount, on the watching goroutine,
// with each count Redis returns. A failed renewal is skipped: the record
// outlives it, and the last count stands. Call it once, when the origin
// goes to work: Provision must not start goroutines.
func (r *Redis) WatchProcesses(interval time.Duration, onCount func(n int64)) {
	if interval <= 0 || onCount == nil {
		return
	}
	go func() {
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			ctx, cancel := context.WithTimeout(context.Background(), interval)
			n, err := r.Heartbeat(ctx, processesLapse*interval)
			cancel()
			if err == nil {
				onCount(n)
			}
			select {
			case <-r.done:
				return
			case <-t.C:
			}
		}
	}()
}
