package origin

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Runtime overrides of the region, in its Redis: operators change a key's
// limit through any node's admin API, and every node of the region reads
// the change as soon as the notice of it arrives (WatchOverrides). The
// values are opaque here; each carries a version (the change's time, in
// microseconds), and a write replaces a field only with a newer version,
// so two nodes that apply the same changes in different orders agree.
//
// Keys, on the endpoint of the role (one hash tag, so a Cluster keeps them
// together):
//
//	<prefix>:{overrides}     field → "<version> <value>", and the
//	                         region's mark under the field "" (a region
//	                         that lost it lost its overrides: the nodes
//	                         write back theirs, RestoreOverrides)
//	<prefix>:{overrides}:v   bumped by every change that took, which
//	                         publishes its new value on the channel of
//	                         the same name
//	<prefix>:{overrides}:q   fields changed here, for the role's holder to
//	                         write to MySQL

// Override is one runtime override as the region's Redis holds it.
type Override struct {
	// Field names the override (its zone and identifier, as the root
	// encodes them).
	Field string
	// Version orders changes of a field: the newer replaces the older.
	Version int64
	// Value is the override, opaque here but for one thing: of two
	// changes of one version (made in two regions past the same held
	// version), the one whose JSON member "region" sorts after the other's,
	// byte by byte, wins, as it does in MySQL, so that every region ends on
	// the same one.
	Value string
}

// overridePutLib is the write of one field that both put scripts make:
// put sets field to "ver val" when ver is newer than the one held, or the
// same and its region after the held one's (see Override), queues it in
// KEYS[3] when queue is set, and returns 1 when it changed, else 0;
// announce bumps KEYS[2] once if any changed, publishing its new value on
// the channel KEYS[2] where the user may. Regions compare byte by byte, as
// MySQL's VARBINARY does (Lua's < follows the server's locale).
const overridePutLib = `
local function region(v)
  local ok, o = pcall(cjson.decode, v)
  if ok and type(o) == 'table' and type(o.region) == 'string' then return o.region end
  return ''
end
local function after(a, b)
  for j = 1, math.min(#a, #b) do
    local x, y = string.byte(a, j), string.byte(b, j)
    if x ~= y then return x > y end
  end
  return #a > #b
end
local function put(field, ver, val, queue)
  local old = redis.call('HGET', KEYS[1], field)
  local ov, oldval = -1, nil
  if old then
    ov = tonumber(string.match(old, '^(%-?%d+)')) or -1
    oldval = string.match(old, '^%-?%d+ (.*)$')
  end
  local nv = tonumber(ver)
  if nv > ov or (nv == ov and oldval ~= nil and after(region(val), region(oldval))) then
    redis.call('HSET', KEYS[1], field, ver .. ' ' .. val)
    if queue then redis.call('RPUSH', KEYS[3], field) end
    return 1
  end
  return 0
end
local function announce(changed)
  if changed > 0 then
    -- pcall: a user without pub/sub channels (Redis 7's default for a new
    -- ACL user) still changes overrides; its nodes read the counter instead.
    redis.pcall('PUBLISH', KEYS[2], redis.call('INCR', KEYS[2]))
  end
end
`

var (
	// overridePutScript writes each field ARGV[3i+1] as "ARGV[3i+2]
	// ARGV[3i+3]" (put), queueing it when ARGV[#ARGV] is "1", and bumps
	// KEYS[2] once if any changed (announce); returns how many changed.
	overridePutScript = redis.NewScript(overridePutLib + `
local changed = 0
local queue = ARGV[#ARGV] == '1'
for i = 1, #ARGV - 1, 3 do
  changed = changed + put(ARGV[i], ARGV[i+1], ARGV[i+2], queue)
end
announce(changed)
return changed
`)
	// overrideCheckedPutScript is overridePutScript's write of one field,
	// made only when what KEYS[1] holds of the field ARGV[1] meets a
	// precondition (OverrideCondition), judged at ARGV[2] (Unix ms, the
	// region's clock): ARGV[3] is If-Match and ARGV[4] If-None-Match, each
	// "" when not given, "*", or " tag tag " (entity tags, quotes
	// included); ARGV[5..7] are the field, version and value written,
	// ARGV[8] "1" to queue it. The check and the write are one step in
	// Redis, so two nodes that change a field at once under one entity
	// tag do not both pass. It returns {1, held} when the change took,
	// {0, held} when the region holds a newer version, {-1, held} when the
	// precondition failed, held being what the checked field held before
	// ("" for nothing).
	overrideCheckedPutScript = redis.NewScript(overridePutLib + `
local held = redis.call('HGET', KEYS[1], ARGV[1]) or ''
local etag, live = nil, false
if held ~= '' then
  local ver, val = string.match(held, '^(%-?%d+) (.*)$')
  if ver then
    local ok, o = pcall(cjson.decode, val)
    if ok and type(o) == 'table' then
      local exp = tonumber(o.expires_ms) or 0
      live = o.deleted ~= true and (exp == 0 or exp > tonumber(ARGV[2]))
    end
    local r = region(val)
    etag = '"' .. ver .. (r ~= '' and ('.' .. r) or '') .. '"'
  end
end
local function named(spec)
  return etag ~= nil and string.find(spec, ' ' .. etag .. ' ', 1, true) ~= nil
end
local match, none = ARGV[3], ARGV[4]
if match ~= '' and (not live or (match ~= '*' and not named(match))) then return {-1, held} end
if none ~= '' and live and (none == '*' or named(none)) then return {-1, held} end
local n = put(ARGV[5], ARGV[6], ARGV[7], ARGV[8] == '1')
announce(n)
return {n, held}
`)
	overrideTakeScript = redis.NewScript(overrideTakeLua)
)

// overrideTakeLua pops up to ARGV[1] queued fields of KEYS[2] and returns
// each with its value in KEYS[1] (fields since removed are skipped). It is
// sent once (runOnce): a Cluster client that sent it again after losing
// its reply popped the next batch, and the first one reached no other
// region.
const overrideTakeLua = `
local fields = redis.call('LRANGE', KEYS[2], 0, tonumber(ARGV[1]) - 1)
if #fields > 0 then redis.call('LTRIM', KEYS[2], #fields, -1) end
local out = {}
for _, f in ipairs(fields) do
  local v = redis.call('HGET', KEYS[1], f)
  if v then table.insert(out, f) table.insert(out, v) end
end
return out
`

func (r *Redis) overridesKey() string { return r.prefix + ":{overrides}" }

// PutOverrides writes overrides that are newer than what the region holds
// of their fields, and queues them for the role's holder when queue is
// set (a change made here, which MySQL has not seen). It returns how many
// took.
func (r *Redis) PutOverrides(ctx context.Context, os []Override, queue bool) (int, error) {
	if len(os) == 0 {
		return 0, nil
	}
	args := make([]any, 0, 3*len(os)+1)
	for _, o := range os {
		args = append(args, o.Field, strconv.FormatInt(o.Version, 10), o.Value)
	}
	args = append(args, map[bool]string{true: "1", false: "0"}[queue])
	ep, k := r.roleEndpoint(), r.overridesKey()
	n, err := overridePutScript.Run(ctx, ep.client, []string{k, k + ":v", k + ":q"}, args...).Int()
	if err != nil {
		return 0, fmt.Errorf("redis put %s %s: %w", k, ep.address, explainScripts(err))
	}
	return n, nil
}

// OverrideCondition is a precondition of a change (If-Match,
// If-None-Match), which the region's Redis checks against what it holds
// of Field in the same step as the write (PutOverrideIf).
type OverrideCondition struct {
	// Field is the field whose held change is compared: the one written,
	// or the one a node's book matched the condition against.
	Field string
	// NowMs is when a held override's expiry is judged (Unix ms, on the
	// region's clock): a lapsed one, or a removal, is not live.
	NowMs int64
	// Match is If-Match, NoneMatch If-None-Match.
	Match, NoneMatch OverrideTags
}

// OverrideTags is one header of an OverrideCondition.
type OverrideTags struct {
	Given bool
	// Any is "*": any live override.
	Any bool
	// Tags are the entity tags that count, quotes included, each as
	// "<version>.<region>" (the region left out when empty): for
	// If-Match, the strong ones only.
	Tags []string
}

// spec is t as overrideCheckedPutScript reads it. Entity tags hold no
// space (a parsed tag holds no byte under 0x21), so spaces delimit them.
func (t OverrideTags) spec() string {
	switch {
	case !t.Given:
		return ""
	case t.Any:
		return "*"
	}
	return " " + strings.Join(t.Tags, " ") + " "
}

// Checked is the outcome of PutOverrideIf.
type Checked struct {
	// Took: the change is held now. Not Took and not Failed: the region
	// holds a newer version of the field written.
	Took bool
	// Failed: the precondition did not hold, and nothing was written.
	Failed bool
	// Held is what the region held of the condition's field before (the
	// change checked against), Holds false when it held nothing.
	Held  Override
	Holds bool
}

// PutOverrideIf writes o, as PutOverrides does, only when what the region
// holds of c.Field meets c, in one script: of two nodes that change a
// field at once under one entity tag, one passes, and the other finds
// the first's change.
func (r *Redis) PutOverrideIf(ctx context.Context, o Override, c OverrideCondition, queue bool) (Checked, error) {
	ep, k := r.roleEndpoint(), r.overridesKey()
	args := []any{c.Field, strconv.FormatInt(c.NowMs, 10), c.Match.spec(), c.NoneMatch.spec(),
		o.Field, strconv.FormatInt(o.Version, 10), o.Value, map[bool]string{true: "1", false: "0"}[queue]}
	reply, err := overrideCheckedPutScript.Run(ctx, ep.client, []string{k, k + ":v", k + ":q"}, args...).Slice()
	if err != nil {
		return Checked{}, fmt.Errorf("redis put %s %s: %w", k, ep.address, err)
	}
	if len(reply) != 2 {
		return Checked{}, fmt.Errorf("redis put %s %s: a reply of %d items", k, ep.address, len(reply))
	}
	status, _ := reply[0].(int64)
	raw, _ := reply[1].(string)
	out := Checked{Took: status == 1, Failed: status == -1}
	out.Held, out.Holds = parseOverride(c.Field, raw)
	return out, nil
}

// OverridesVersion returns the region's change counter of overrides: it
// moves with every change, so a node re-reads them only when it moved.
func (r *Redis) OverridesVersion(ctx context.Context) (int64, error) {
	ep, k := r.roleEndpoint(), r.overridesKey()
	v, err := ep.client.Get(ctx, k+":v").Int64()
	if errors.Is(err, redis.Nil) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("redis %s version %s: %w", k, ep.address, err)
	}
	return v, nil
}

// markField is the field of the hash that holds the region's mark: a
// random word set by the first node that finds none. The root's fields
// all name a zone and an identifier, never "", and a mark holds no
// space, so the reads here (parseOverride) pass over it.
const markField = ""

// OverridesState returns the region's change counter of overrides and
// its mark ("" when none is set), in one round trip. The mark goes only
// with the hash, and the counter only moves up: a node that finds
// another mark than the one it saw, or a counter lower than it saw, is
// looking at a region that lost its overrides (Redis restarted empty,
// flushed, failed over to a replica that had not got them, the hash
// evicted or deleted), and writes back those it holds
// (RestoreOverrides).
func (r *Redis) OverridesState(ctx context.Context) (int64, string, error) {
	ep, k := r.roleEndpoint(), r.overridesKey()
	pipe := ep.client.Pipeline()
	ver := pipe.Get(ctx, k+":v")
	mark := pipe.HGet(ctx, k, markField)
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return 0, "", fmt.Errorf("redis %s state %s: %w", k, ep.address, err)
	}
	v, _ := ver.Int64()
	return v, mark.Val(), nil
}

// MarkOverrides sets the region's mark when it has none, and returns the
// mark it holds then.
func (r *Redis) MarkOverrides(ctx context.Context) (string, error) {
	ep, k := r.roleEndpoint(), r.overridesKey()
	pipe := ep.client.Pipeline()
	pipe.HSetNX(ctx, k, markField, rand.Text())
	mark := pipe.HGet(ctx, k, markField)
	if _, err := pipe.Exec(ctx); err != nil {
		return "", fmt.Errorf("redis %s mark %s: %w", k, ep.address, err)
	}
	return mark.Val(), nil
}

// restoreBatch bounds the fields of one script call of RestoreOverrides:
// Redis runs nothing else while a script runs, and a thousand fields take
// about a millisecond.
const restoreBatch = 1000

// RestoreOverrides writes back overrides a node holds to a region that
// lost them, restoreBatch at a time, through PutOverrides: a field takes
// a version only when it is newer than the one the region holds, so
// several nodes writing back at once, some of them with stale copies,
// leave the newest of each field, and a removal (a newer version) keeps
// out the override it removed. A batch that changed nothing moves no
// counter. It returns how many fields took.
func (r *Redis) RestoreOverrides(ctx context.Context, os []Override, queue bool) (int, error) {
	took := 0
	for start := 0; start < len(os); start += restoreBatch {
		n, err := r.PutOverrides(ctx, os[start:min(start+restoreBatch, len(os))], queue)
		took += n
		if err != nil {
			return took, err
		}
	}
	return took, nil
}

// noticeRetry is the first pause before a subscription to the notices of
// changes that failed or broke is made again; each failure in a row
// doubles it, up to maxNoticeRetry (a user whom Redis refuses the channel
// tries again twice a minute, in case it was granted).
const (
	noticeRetry    = 10 * time.Millisecond
	maxNoticeRetry = 30 * time.Second
)

// WatchOverrides subscribes to the region's notices of override changes
// (each change publishes the new change counter) until ctx ends or the
// origin closes. It calls notice(true) once subscribed, and again on each
// notice, and notice(false) when the subscription failed or broke, after
// which it subscribes again. Changes made while no subscription was live
// are not announced: a caller that hears notice(true) after notice(false)
// reads the change counter.
func (r *Redis) WatchOverrides(ctx context.Context, notice func(live bool)) {
	tell := notice
	notice = func(live bool) {
		r.notices.Store(live)
		tell(live)
	}
	defer r.notices.Store(false)
	pause := noticeRetry
	for {
		if r.subscribe(ctx, notice) {
			pause = noticeRetry
		}
		if ctx.Err() != nil || r.closed.Load() {
			return
		}
		notice(false)
		select {
		case <-time.After(pause):
		case <-ctx.Done():
			return
		case <-r.done:
			return
		}
		pause = min(2*pause, maxNoticeRetry)
	}
}

// OverrideNotices tells whether WatchOverrides is subscribed now.
func (r *Redis) OverrideNotices() bool { return r.notices.Load() }

// subscribe is one subscription of WatchOverrides, from SUBSCRIBE until
// it fails, breaks, or ctx ends or the origin closes; it reports whether
// it was live at some point.
func (r *Redis) subscribe(ctx context.Context, notice func(live bool)) (live bool) {
	ps := r.roleEndpoint().client.Subscribe(ctx, r.overridesKey()+":v")
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		select {
		case <-ctx.Done():
		case <-r.done:
		case <-stop:
		}
		_ = ps.Close() // ends a Receive that waits
	}()
	for {
		msg, err := ps.Receive(context.Background())
		if err != nil || ctx.Err() != nil || r.closed.Load() {
			return live
		}
		switch msg.(type) {
		case *redis.Subscription, *redis.Message:
			live = true
			notice(true)
		}
	}
}

// Overrides returns every override the region holds and the change
// counter they are as of.
func (r *Redis) Overrides(ctx context.Context) (int64, []Override, error) {
	ep, k := r.roleEndpoint(), r.overridesKey()
	pipe := ep.client.Pipeline()
	ver := pipe.Get(ctx, k+":v")
	all := pipe.HGetAll(ctx, k)
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return 0, nil, fmt.Errorf("redis %s %s: %w", k, ep.address, err)
	}
	v, _ := ver.Int64()
	out := make([]Override, 0, len(all.Val()))
	for f, raw := range all.Val() {
		if o, ok := parseOverride(f, raw); ok {
			out = append(out, o)
		}
	}
	return v, out, nil
}

// TakeOverrides returns the overrides changed in the region that the role's
// holder has not taken yet, up to roleQueueBatch; with all, every one the
// region holds (a new holder's first look: what a dead one took and did
// not write is written again, which the newer-wins writes make harmless).
func (r *Redis) TakeOverrides(ctx context.Context, all bool) ([]Override, error) {
	if all {
		_, os, err := r.Overrides(ctx)
		return os, err
	}
	ep := r.roleEndpoint()
	k := r.overridesKey()
	keys, args := []string{k, k + ":q"}, []any{roleQueueBatch}
	cmd := ep.runOnce(ctx, "evalsha", overrideTakeScript.Hash(), keys, args)
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		cmd = ep.runOnce(ctx, "eval", overrideTakeLua, keys, args)
	}
	vals, err := cmd.StringSlice()
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("redis take overrides %s: %w", ep.address, explainScripts(err))
	}
	var out []Override
	for i := 0; i+1 < len(vals); i += 2 {
		if o, ok := parseOverride(vals[i], vals[i+1]); ok {
			out = append(out, o)
		}
	}
	return out, nil
}

// DropOverrides removes each override's field if it still holds that
// version: one that lapsed or a removal old enough to have reached every
// region. A newer change of the field stays.
func (r *Redis) DropOverrides(ctx context.Context, os []Override) error {
	if len(os) == 0 {
		return nil
	}
	args := make([]any, 0, 2*len(os))
	for _, o := range os {
		args = append(args, o.Field, strconv.FormatInt(o.Version, 10)+" "+o.Value)
	}
	ep, k := r.roleEndpoint(), r.overridesKey()
	if err := forgetScript.Run(ctx, ep.client, []string{k}, args...).Err(); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("redis drop %s %s: %w", k, ep.address, explainScripts(err))
	}
	return nil
}

// parseOverride splits a held value into its version and value.
func parseOverride(field, raw string) (Override, bool) {
	ver, val, ok := strings.Cut(raw, " ")
	if !ok {
		return Override{}, false
	}
	v, err := strconv.ParseInt(ver, 10, 64)
	if err != nil {
		return Override{}, false
	}
	return Override{Field: field, Version: v, Value: val}, true
}

// OverrideVersion returns the version the region holds of one field (false
// when it holds none): a holder checks that a change is new to the region
// before acting on it.
func (r *Redis) OverrideVersion(ctx context.Context, field string) (int64, bool, error) {
	o, ok, err := r.HeldOverride(ctx, field)
	return o.Version, ok, err
}

// HeldOverride returns what the region holds of one field, version and
// value (false when it holds none).
func (r *Redis) HeldOverride(ctx context.Context, field string) (Override, bool, error) {
	ep := r.roleEndpoint()
	raw, err := ep.client.HGet(ctx, r.overridesKey(), field).Result()
	if errors.Is(err, redis.Nil) {
		return Override{}, false, nil
	}
	if err != nil {
		return Override{}, false, fmt.Errorf("redis override version %s: %w", ep.address, err)
	}
	o, ok := parseOverride(field, raw)
	return o, ok, nil
}
