package origin

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"maps"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// A Redis restarted empty has lost every process's own totals. The
// writes are idempotent, so each process repairs what it writes next, but
// a key no request touches any more would stay short of its units for the
// rest of its window: the other processes would admit them again. So the
// origin watches each server's run ID (INFO server), which a restart
// changes, and tells its owner, who sends every live cell's total again
// (engine.Resend). A failover to a replica changes the run ID too (in a
// Cluster, the address of the slots' master): the replica may have missed
// the last writes, and sending the totals again re-adds exactly those, a
// no-op when it has them all.
// An operator's FLUSHALL or FLUSHDB empties a server as a restart does, and
// keeps its run ID: so the watch also keeps a mark in each server (a key
// holding a random value, markKey), which a flush takes away, and a mark
// missing or changed is a restart too. A mark an evicting Redis dropped
// is one as well: it lost counts then, and sending the totals again
// repairs those of the live cells. In a Cluster each master keeps a mark
// of its own, in a slot it serves (clusterMarkKey).
// The runtime overrides were lost with the totals: their owner's watch
// of them reads Restarts, as well as the region's mark of them
// (OverridesState), and writes back those its node holds.

// runIDTimeout bounds one check of the run IDs.
const runIDTimeout = time.Second

// WatchRestarts checks every endpoint's run IDs (every master's in a
// Cluster) at once and then every interval until Close, and calls
// onRestart, on the watching goroutine, when one of them changed since it
// was last seen.
// The first run IDs seen are the reference, unless the origin took the
// watch of another (TakeWatchFrom); an unreachable server is skipped
// until it answers. Call it once, when the origin goes to work:
// Provision must not start goroutines.
func (r *Redis) WatchRestarts(interval time.Duration, onRestart func()) {
	if interval <= 0 || onRestart == nil {
		return
	}
	w := r.watch
	go func() {
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			// The first check at once: a process started just before a
			// restart would otherwise take the emptied server for its
			// reference, and never send what it wrote before.
			w.check(onRestart)
			select {
			case <-r.done:
				return
			case <-t.C:
			}
		}
	}()
}

// TakeWatchFrom makes the run IDs and marks that prev's watch last saw
// the reference of r's, and retires prev's watch until it takes them
// back. Call it when r replaces prev, an origin of the same placement
// (a reload that changed something else): r's watch would otherwise
// start from the run IDs it first reads, and a Redis that restarted (or
// was flushed) after prev's last check and before r's first went unseen
// by both. prev's watch, no longer the one its owner acts on, would have
// seen it and told no one (TestCaddy_RedisRestartedAroundAReloadGetsTheCountsBack).
// A check of prev's under way when r takes over either ends before (and
// its owner acts on what it saw) or finds prev retired and keeps nothing.
func (r *Redis) TakeWatchFrom(prev *Redis) {
	if prev == nil || prev == r {
		return
	}
	from, to := prev.watch, r.watch
	from.mu.Lock()
	from.retired = true
	seen, marks := maps.Clone(from.seen), maps.Clone(from.marks)
	masters := map[string]map[string]bool{}
	for addr, m := range from.masters {
		masters[addr] = maps.Clone(m)
	}
	from.mu.Unlock()
	to.mu.Lock()
	defer to.mu.Unlock()
	to.retired = false
	maps.Copy(to.seen, seen)
	maps.Copy(to.marks, marks)
	for addr := range marks {
		delete(to.markedAt, addr) // read at the next check
	}
	maps.Copy(to.masters, masters)
}

// Restarts returns how many run ID changes the watch has seen: the
// region's overrides watch compares it between its looks, and writes
// back the overrides its node holds after each (a restarted Redis that
// has them takes nothing).
func (r *Redis) Restarts() uint64 { return r.restarts.Load() }

// RunIDChecks returns how many checks of the run IDs the watch made: a
// restart is seen only once one check read the server before it.
func (r *Redis) RunIDChecks() uint64 { return r.runIDChecks.Load() }

// restartWatch remembers the run ID of every server seen.
type restartWatch struct {
	r *Redis
	// mu guards the rest, and is held while the watch compares what it
	// read with what it saw and tells its owner (TakeWatchFrom).
	mu sync.Mutex
	// retired: another origin took the watch's reference (TakeWatchFrom);
	// it reads nothing until it takes it back.
	retired bool
	seen    map[string]string // server address → run ID
	// masters holds, per Cluster endpoint's address, the addresses of the
	// masters that served its slots at the last check that read the slot
	// map.
	masters map[string]map[string]bool
	// marks holds the mark seen in each server, by address (markKey),
	// and markedAt when the watch read it.
	marks    map[string]string
	markedAt map[string]time.Time
	// asked holds the servers this watch asked whether they may evict and
	// run scripts: each once, and again after a restart. TakeWatchFrom
	// does not hand it on, so a reload's origin asks again.
	asked map[string]bool
}

func newRestartWatch(r *Redis) *restartWatch {
	return &restartWatch{r: r, seen: map[string]string{}, masters: map[string]map[string]bool{},
		marks: map[string]string{}, markedAt: map[string]time.Time{}, asked: map[string]bool{}}
}

// markEvery is how often the watch reads each server's mark: a flush is
// an operator's rare act, and the mark's read, every slow_tick of every
// node, doubled what an idle node costs its Redis (31 commands a second
// and 20 more; now 1 more).
const markEvery = time.Second

// reading is what one check read of an endpoint.
type reading struct {
	ep      *endpoint
	ids     map[string]server
	masters map[string]bool // nil outside a Cluster
	marks   map[string]string
}

// check reads every server's run ID and, when one changed, calls
// onRestart. A server seen for the first time, or restarted, is asked
// whether it may evict keys (Options.OnEvicting) and whether it runs
// scripts (Options.OnScriptsRefused).
//
// In a Cluster a failover promotes a replica at another address, which
// the watch has never read: that is a change too, whatever its run ID,
// since the replica may have missed the last writes its master took (an
// asynchronous replica always may). So is any master that was not one at
// the last check, a former master failed over back to among them: its
// run ID may be the one seen before it lost its slots, with writes it
// never got. A master given slots by a resharding counts as well; the
// resend that follows costs writes and changes no count.
func (w *restartWatch) check(onRestart func()) {
	w.mu.Lock()
	retired := w.retired
	due := map[string]bool{}
	for addr, at := range w.markedAt {
		due[addr] = time.Since(at) >= markEvery
	}
	seen := maps.Clone(w.seen)
	w.mu.Unlock()
	if retired {
		return
	}
	// Read outside the lock: a server that does not answer holds a check
	// up to runIDTimeout, and TakeWatchFrom, in a reload, waits for none.
	var reads []reading
	for _, ep := range w.r.endpoints {
		ctx, cancel := context.WithTimeout(context.Background(), runIDTimeout)
		start := time.Now()
		ids, masters := runIDs(ctx, ep, w.r.prefix)
		if rtt := time.Since(start); len(ids) > 0 && (masters == nil || len(ids) == len(masters)) {
			// Every server of the endpoint answered: an open breaker need
			// not wait out its timeout to hear it (breaker.answeredOutside).
			ep.requests.answeredOutside(start, rtt)
			ep.replay.answeredOutside(start, rtt)
		}
		rd := reading{ep: ep, ids: ids, masters: masters, marks: map[string]string{}}
		for addr, srv := range ids {
			// A server restarted lost its mark with the rest: the one
			// known would count the same restart again at the next read
			// (and again in the origin a reload hands the watch to).
			if d, ok := due[addr]; srv.mark != "" && (d || !ok || seen[addr] != srv.id) {
				// Emptied without a restart (FLUSHALL): its mark changed.
				if m := mark(ctx, srv.client, srv.mark); m != "" {
					rd.marks[addr] = m
				}
			}
		}
		cancel()
		reads = append(reads, rd)
	}
	w.mu.Lock()
	if w.retired {
		w.mu.Unlock()
		return
	}
	changed := false
	var fresh []server // first seen, or restarted
	for _, rd := range reads {
		if w.compare(rd, &fresh) {
			changed = true
		}
	}
	for _, srv := range fresh {
		w.asked[srv.addr] = true
	}
	for _, rd := range reads {
		for addr, srv := range rd.ids {
			if !w.asked[addr] { // seen by the origin this watch took over from
				w.asked[addr] = true
				srv.addr = addr
				fresh = append(fresh, srv)
			}
		}
	}
	w.r.runIDChecks.Add(1)
	if changed {
		w.r.restarts.Add(1)
		onRestart()
	}
	w.mu.Unlock()
	for _, srv := range fresh {
		ctx, cancel := context.WithTimeout(context.Background(), runIDTimeout)
		if w.r.opts.OnEvicting != nil {
			if policy, max := evictionPolicy(ctx, srv.client); max > 0 && policy != "" && policy != "noeviction" {
				w.r.opts.OnEvicting(srv.addr, policy, max)
			}
		}
		if w.r.opts.OnScriptsRefused != nil {
			if err := probeScripts(ctx, srv.client); err != nil {
				w.r.opts.OnScriptsRefused(srv.addr, err)
			}
		}
		cancel()
	}
}

// compare records what a check read of one endpoint, under w.mu, and
// reports whether a server changed since the last; it adds the servers
// first seen or restarted to fresh.
func (w *restartWatch) compare(rd reading, fresh *[]server) bool {
	changed := false
	if rd.masters != nil {
		prev, checked := w.masters[rd.ep.address]
		next := map[string]bool{}
		for addr := range rd.masters {
			_, answered := rd.ids[addr]
			switch {
			case answered && checked && !prev[addr]:
				changed = true
				next[addr] = true
			case answered, prev[addr], !checked:
				// A new master that does not answer yet stays new
				// until it does.
				next[addr] = true
			}
		}
		for addr := range prev {
			if !rd.masters[addr] {
				delete(w.seen, addr) // met again as a master, it is new
			}
		}
		w.masters[rd.ep.address] = next
	}
	for addr, srv := range rd.ids {
		old, ok := w.seen[addr]
		if ok && old != srv.id {
			changed = true
		}
		w.seen[addr] = srv.id
		if m, read := rd.marks[addr]; read {
			if was, ok := w.marks[addr]; ok && was != m {
				changed = true
			}
			w.marks[addr] = m
			w.markedAt[addr] = time.Now()
		}
		if old != srv.id {
			srv.addr = addr
			*fresh = append(*fresh, srv)
		}
	}
	return changed
}

// markKey is the key of the watch's mark in each server outside a
// Cluster.
func markKey(prefix string) string { return prefix + ":{mark}" }

// clusterMarkKey is the key of the watch's mark on a Cluster master that
// serves the slots lo to hi: the first of prefix:{mark-0}, {mark-1}, …
// whose hash tag lies in them; "" when none of the first maxMarkTags
// does (a range of a few slots may be missed; the master then has no
// mark). A master given other slots by a resharding gets another key,
// and its mark counts as changed: the resend that follows costs writes
// and changes no count.
func clusterMarkKey(prefix string, lo, hi int) string {
	for n := range maxMarkTags {
		tag := "mark-" + strconv.Itoa(n)
		if s := int(crc16(tag) % clusterSlots); lo <= s && s <= hi {
			return prefix + ":{" + tag + "}"
		}
	}
	return ""
}

const (
	// clusterSlots is the number of a Cluster's hash slots.
	clusterSlots = 16384
	// maxMarkTags bounds the search for a mark key in a master's slots.
	maxMarkTags = 1 << 16
)

// crc16 is the CRC-16/XMODEM of s, Redis Cluster's key hash.
func crc16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc ^= uint16(s[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

// mark returns the mark the server holds at key (one GET), which it sets
// to a new random value when the server has none; "" when the server does not
// answer (or lost the key between the two commands: the next check reads
// it). The key has no expiry: only a flush, a restart without persistence
// or an eviction takes it away, and each of these lost counts.
func mark(ctx context.Context, c redis.Cmdable, key string) string {
	m, err := c.Get(ctx, key).Result()
	if err == nil {
		return m
	}
	if err != redis.Nil {
		return ""
	}
	// None: set one, unless another node's watch set it meanwhile.
	var b [8]byte
	_, _ = rand.Read(b[:])
	fresh := hex.EncodeToString(b[:])
	pipe := c.Pipeline()
	set := pipe.SetNX(ctx, key, fresh, 0)
	get := pipe.Get(ctx, key)
	if _, err := pipe.Exec(ctx); err != nil {
		return ""
	}
	if set.Val() {
		return fresh
	}
	return get.Val()
}

// server is one server of an endpoint, as the watch reads it.
type server struct {
	id, addr string
	client   redis.Cmdable
	// mark is the key of the watch's mark on the server; "" for none.
	mark string
}

// runIDs returns the run ID of the endpoint's server, or of each master of
// a Cluster, by address; servers that do not answer are left out. For a
// Cluster it also returns the address of every master that serves slots,
// answering or not (nil when the slot map could not be read, and for
// other endpoints).
func runIDs(ctx context.Context, ep *endpoint, prefix string) (map[string]server, map[string]bool) {
	out := map[string]server{}
	if c, ok := ep.client.(*redis.ClusterClient); ok {
		// Each master's first range of slots, for its mark.
		marks := map[string]string{}
		if slots, err := c.ClusterSlots(ctx).Result(); err == nil {
			for _, sl := range slots {
				if len(sl.Nodes) > 0 && marks[sl.Nodes[0].Addr] == "" {
					marks[sl.Nodes[0].Addr] = clusterMarkKey(prefix, sl.Start, sl.End)
				}
			}
		}
		var mu sync.Mutex
		masters := map[string]bool{}
		err := c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
			addr := m.Options().Addr
			mu.Lock()
			masters[addr] = true
			mu.Unlock()
			if id := runID(ctx, m); id != "" {
				mu.Lock()
				out[addr] = server{id: id, client: m, mark: marks[addr]}
				mu.Unlock()
			}
			return nil
		})
		if err != nil || len(masters) == 0 {
			masters = nil
		}
		return out, masters
	}
	if id := runID(ctx, ep.client); id != "" {
		out[ep.address] = server{id: id, client: ep.client, mark: markKey(prefix)}
	}
	return out, nil
}

// runID returns the server's run ID, or "" when it does not answer.
func runID(ctx context.Context, c redis.Cmdable) string {
	return infoField(ctx, c, "server", "run_id")
}

// evictionPolicy returns the server's maxmemory_policy and maxmemory
// (INFO memory); 0 when it has no memory limit or does not answer.
func evictionPolicy(ctx context.Context, c redis.Cmdable) (string, int64) {
	info, err := c.Info(ctx, "memory").Result()
	if err != nil {
		return "", 0
	}
	max, _ := strconv.ParseInt(field(info, "maxmemory"), 10, 64)
	return field(info, "maxmemory_policy"), max
}

// infoField returns one field of an INFO section, or "".
func infoField(ctx context.Context, c redis.Cmdable, section, name string) string {
	info, err := c.Info(ctx, section).Result()
	if err != nil {
		return ""
	}
	return field(info, name)
}

// field returns the value of name in an INFO reply, or "".
func field(info, name string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(line, name+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}
