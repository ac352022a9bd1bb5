package origin

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Reserve decides one request at Redis in one script (scripts.go): it raises
// this process's own total to res.Own, then admits res.Cost only if the
// region's count allows, charging it in the same step. It returns by ctx's
// deadline whatever Redis does, and at once when the request-path breaker
// is open.
func (r *Redis) Reserve(ctx context.Context, res *engine.Reservation) error {
	start := time.Now()
	ep := r.route(res.Key)
	err := ep.reserve(ctx, res)
	ep.record(OpReserve, err, start, 1)
	if err != nil {
		return fmt.Errorf("redis reserve %s (zone %q): %w", ep.address, res.Key.Namespace, err)
	}
	return nil
}

// reserve runs the reservation script for res: its own cost first, then
// the costs of the requests that joined it (res.Joined), in order.
func (ep *endpoint) reserve(ctx context.Context, res *engine.Reservation) error {
	if err := ep.ready(ctx, res.Key.Window); err != nil {
		return err
	}
	keys, args, err := ep.reserveArgs(res)
	if err != nil {
		return err
	}
	if err := ep.begin(); err != nil {
		return err
	}
	defer ep.end()
	var vals []any
	err = ep.requests.guard(1, func() error {
		ep.roundTrips.Add(1)
		// EVALSHA, and EVAL when Redis lost the script: a NOSCRIPT reply
		// means nothing ran, so the second call charges once.
		cmd := ep.runOnce(ctx, "evalsha", reserveScript.Hash(), keys, args)
		if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
			cmd = ep.runOnce(ctx, "eval", reserveLua, keys, args)
		}
		var err error
		vals, err = cmd.Slice()
		return err
	})
	if err != nil {
		return err
	}
	return parseReservation(vals, res)
}

// runOnce sends one call of a script (name is evalsha or eval, script its
// hash or source) that go-redis must not send again: its Cluster client
// sends a command whose reply it lost (the connection closed, or its
// socket timed out within the call's deadline) once more to the same node
// and then to another, whatever MaxRetries says, and every run of the
// reservation script charges its costs.
// Both runs of a lost reply's reservation once stayed in the region's count
// (TestReserve_AClusterRunsAReservationOnce). A redirection (MOVED, ASK)
// and a refusal before the script ran (READONLY) are still followed.
func (ep *endpoint) runOnce(ctx context.Context, name, script string, keys []string, args []any) *redis.Cmd {
	all := make([]any, 0, 3+len(keys)+len(args))
	all = append(all, name, script, len(keys))
	for _, k := range keys {
		all = append(all, k)
	}
	cmd := redis.NewCmd(ctx, append(all, args...)...)
	_ = ep.client.Process(ctx, noRetryCmd{cmd})
	return cmd
}

// noRetryCmd is a command that go-redis sends once (see runOnce), and a
// pipeline holding one is sent once too (the role's pops of its queues).
type noRetryCmd struct{ redis.Cmder }

// NoRetry tells go-redis not to send the command again.
func (noRetryCmd) NoRetry() bool { return true }

// reserveArgs returns the keys and arguments of reserveLua for res, or why
// res may not be sent: a count out of range, checked before anything is.
func (ep *endpoint) reserveArgs(res *engine.Reservation) (keys []string, args []any, err error) {
	if res.Own < 0 || res.Own > engine.MaxCount || res.Cost < 0 || res.Cost > engine.MaxCount ||
		res.Limit < 0 || res.Limit > engine.MaxCount {
		return nil, nil, fmt.Errorf("reservation out of range: own %d, cost %d, limit %d", res.Own, res.Cost, res.Limit)
	}
	costs := strconv.AppendInt(make([]byte, 0, 8*(1+len(res.Joined))), res.Cost, 10)
	for _, c := range res.Joined {
		if c < 0 || c > engine.MaxCount {
			return nil, nil, fmt.Errorf("reservation out of range: joined cost %d", c)
		}
		costs = strconv.AppendInt(append(costs, ' '), c, 10)
	}
	cur, prev := cellKeys(ep.r.prefix, res.Key, res.Sequence)
	keys = []string{cur, prev}
	args = []any{ep.r.nodeID + "." + strconv.FormatUint(uint64(res.Incarnation), 10), res.Own, expireAt(res.Key, res.Sequence).UnixMilli(), string(costs), res.Limit,
		windowMs(res.Key.Window), res.Elapsed, engine.ClampCount(res.Global), engine.ClampCount(res.GlobalPrev)}
	return keys, args, nil
}

// parseReservation stores in res the verdicts and totals of reserveLua's
// reply vals.
func parseReservation(vals []any, res *engine.Reservation) error {
	if len(vals) != 7 {
		return fmt.Errorf("reserve script returned %v", vals)
	}
	verdicts, ok := vals[0].(string)
	if !ok || len(verdicts) != 1+len(res.Joined) {
		return fmt.Errorf("reserve script returned %v", vals)
	}
	var n [6]int64
	for i := range n {
		if n[i], ok = vals[i+1].(int64); !ok {
			return fmt.Errorf("reserve script returned %v", vals)
		}
	}
	res.Admitted = verdicts[0] == '1'
	res.JoinedAdmitted = make([]bool, len(res.Joined))
	for i := range res.Joined {
		res.JoinedAdmitted[i] = verdicts[i+1] == '1'
	}
	res.Totals = totalsOf(n)
	return nil
}
