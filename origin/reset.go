package origin

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Resets of a key for the whole region: an operator makes a key start over
// from zero in its current window on every node of the region. With
// idempotent per-incarnation totals, deleting the cell would be no reset
// (every node writes its total back on its next replay), so a reset marks
// the cell instead: r and rg hold what t and g were at the reset, and every
// script says t − r and g − rg (scripts.go). The units written after the
// reset count as usual, those from before never come back. The previous
// cell is marked too, so the key's previous window weighs nothing.
//
// Which keys were reset reaches the region's nodes as an override record
// (the root's, opaque here: overrides.go), so that each drops its own
// state of the key.

// resetScript marks each existing cell KEYS[i]: r := t, rg := g.
var resetScript = redis.NewScript(`
for i = 1, #KEYS do
  local v = redis.call('HMGET', KEYS[i], 't', 'g')
  if v[1] then redis.call('HSET', KEYS[i], 'r', v[1], 'rg', v[2] or '0') end
end
return 0
`)

// ResetCells marks the key's cell seq and the one before it as reset.
func (r *Redis) ResetCells(ctx context.Context, key engine.Key, seq int64) error {
	ep := r.route(key)
	cur, prev := cellKeys(r.prefix, key, seq)
	if err := resetScript.Run(ctx, ep.client, []string{cur, prev}).Err(); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("redis reset %s (zone %q): %w", ep.address, key.Namespace, err)
	}
	return nil
}
