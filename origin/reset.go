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
// The region's resets are kept like its overrides (overrides.go): a hash
// of field → "<version> <value>" at <prefix>:{resets}, with a change
// counter the nodes poll, so that each drops its own state of the key.

// resetScript marks each existing cell KEYS[i]: r := t, rg := g.
var resetScript = redis.NewScript(`
for i = 1, #KEYS do
  local v = redis.call('HMGET', KEYS[i], 't', 'g')
  if v[1] then redis.call('HSET', KEYS[i], 'r', v[1], 'rg', v[2] or '0') end
end
return 0
`)

func (r *Redis) resetsKey() string { return r.prefix + ":{resets}" }

// ResetCells marks the key's cell seq and the one before it as reset.
func (r *Redis) ResetCells(ctx context.Context, key engine.Key, seq int64) error {
	ep := r.route(key)
	cur, prev := cellKeys(r.prefix, key, seq)
	if err := resetScript.Run(ctx, ep.client, []string{cur, prev}).Err(); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("redis reset %s (zone %q): %w", ep.address, key.Namespace, err)
	}
	return nil
}

// PutResets records resets for the region's nodes (newest version wins);
// it returns how many took.
func (r *Redis) PutResets(ctx context.Context, rs []Override) (int, error) {
	return r.putVersioned(ctx, r.resetsKey(), rs, false)
}

// ResetsVersion is the region's change counter of resets.
func (r *Redis) ResetsVersion(ctx context.Context) (int64, error) {
	return r.versionOf(ctx, r.resetsKey())
}

// Resets returns every reset the region holds and the change counter they
// are as of.
func (r *Redis) Resets(ctx context.Context) (int64, []Override, error) {
	return r.allVersioned(ctx, r.resetsKey())
}

// DropResets removes resets at the versions given (those of a window
// that ended).
func (r *Redis) DropResets(ctx context.Context, rs []Override) error {
	return r.dropVersioned(ctx, r.resetsKey(), rs)
}
