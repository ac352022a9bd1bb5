package sim

import (
	"context"

	"github.com/edgelimit/caddy-ratelimit/engine"
	"github.com/edgelimit/caddy-ratelimit/internal/simmodel"
)

// breakerOrigin is a node's origin behind the endpoint's two breakers
// (origin/breaker.go, origin/endpoint.go): reads and reservations go
// through the request path's, flushes through the replay's, each with the
// origin's defaults. Open, a breaker fails its calls at once without
// reaching Redis, until its timeout lets a probe through or, sooner, the
// node's restart watch hears Redis at its slow tick (Gate.Heard, run.go):
// a region's Redis restarted after an outage is read and written again
// from each node's next slow tick, and the nodes decide alone until then.
type breakerOrigin struct {
	engine.Origin
	requests, replay *simmodel.Gate
}

func (o breakerOrigin) Read(ctx context.Context, key engine.Key, seq int64, inc uint32) (engine.Totals, error) {
	var t engine.Totals
	err := o.requests.Do(func() error {
		var err error
		t, err = o.Origin.Read(ctx, key, seq, inc)
		return err
	})
	return t, err
}

func (o breakerOrigin) Flush(ctx context.Context, batch []engine.Delta) error {
	return o.replay.Do(func() error { return o.Origin.Flush(ctx, batch) })
}

func (o breakerOrigin) Reserve(ctx context.Context, r *engine.Reservation) error {
	return o.requests.Do(func() error { return o.Origin.Reserve(ctx, r) })
}
