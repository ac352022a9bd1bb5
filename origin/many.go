package origin

import (
	"fmt"
	"math/bits"
	"strings"
	"unsafe"

	"github.com/redis/go-redis/v9"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// Reads and writes (cellsLua) take chunks of cells: one call
// carries many, so the fixed cost of a command (its value, its arguments as
// values, its reply as values) is shared by the chunk. Their arguments are
// a few buffers and their reply is one string, so the cost per cell on this
// side is a few bytes copied.

// manyChunk is the most cells one call carries. A script holds Redis for
// its whole run, so a chunk bounds that (64 cells run in well under a
// millisecond) while the fixed cost of a call is shared by many cells.
const manyChunk = 64

// chunk is the most cells one call to ep carries: manyChunk, or 1 in a
// Cluster, where the cells of different keys lie in different slots (the
// two keys of one cell share its hash tag, so its slot).
func (ep *endpoint) chunk() int {
	if ep.kind == KindCluster {
		return 1
	}
	return manyChunk
}

// manyArgs returns one EVALSHA of script over n cells, or with src (the
// script's source) one EVAL of it: per cell i, named by
// cell(i), its key and the keys its flags name (appendCellKeys); then the
// node ID and one string of each cell's numbers, written by nums(b, i),
// each followed by its flags as one digit, separated by spaces. The keys
// share one string, and the command refers to them by pointer, which
// go-redis writes as strings without a value per key.
func (ep *endpoint) manyArgs(script *redis.Script, src string, n int, cell func(i int) (k engine.Key, seq int64, f cellFlags), nums func(b []byte, i int) []byte) []any {
	// The keys' bytes as a capacity: a key's stem plus room for the window,
	// the sequence and the suffix (an identifier that needs escaping grows
	// the buffer once), once more for each other cell a cell's flags name.
	size, nkeys := 0, 0
	for i := range n {
		k, _, f := cell(i)
		m := 1 + bits.OnesCount8(uint8(f))
		size += m * (len(ep.r.prefix) + len(k.Namespace) + len(k.Identifier) + 32)
		nkeys += m
	}
	kb, nb := make([]byte, 0, size), make([]byte, 0, 32*n)
	ends := make([]int, 0, nkeys)
	for i := range n {
		k, seq, f := cell(i)
		var e [3]int
		kb, e = appendCellKeys(kb, ep.r.prefix, k, seq, f)
		ends = append(ends, e[0])
		if f&withPrev != 0 {
			ends = append(ends, e[1])
		}
		if f&markNext != 0 {
			ends = append(ends, e[2])
		}
		if i > 0 {
			nb = append(nb, ' ')
		}
		nb = append(nums(nb, i), ' ', '0'+byte(f))
	}
	// kb and nb are never written again: the keys can share kb's bytes,
	// and the numbers' argument is nb's.
	all := unsafe.String(unsafe.SliceData(kb), len(kb))
	keys := make([]string, len(ends))
	args := make([]any, 0, 3+len(keys)+2)
	if src != "" {
		args = append(args, "eval", src, len(keys))
	} else {
		args = append(args, "evalsha", script.Hash(), len(keys))
	}
	from := 0
	for i, end := range ends {
		keys[i] = all[from:end]
		from = end
		args = append(args, &keys[i])
	}
	return append(args, &ep.r.nodeID, unsafe.String(unsafe.SliceData(nb), len(nb)))
}

// parseMany reads the reply of cellsLua over n cells: per cell, six
// counts or "e" (Redis refused the cell's commands). It calls each for
// every cell with its totals, and returns how many cells were refused. A
// malformed reply stops it: the cells left are not reported.
func parseMany(reply string, n int, each func(i int, t engine.Totals)) (refused int) {
	for i := range n {
		if reply == "e" || strings.HasPrefix(reply, "e ") {
			refused++
			reply = reply[min(2, len(reply)):]
			continue
		}
		var v [6]int64
		for k := range v {
			var ok bool
			if v[k], reply, ok = nextCount(reply); !ok {
				return refused
			}
		}
		each(i, totalsOf(v))
	}
	return refused
}

// nextCount reads the count s begins with, up to a space or the end, and
// returns what follows the space. A count is 1 to 18 decimal digits (the
// scripts return at most 16: engine.MaxCount); anything else is not one
// (ok false): no sign, no empty field.
func nextCount(s string) (v int64, rest string, ok bool) {
	i := 0
	for ; i < len(s) && s[i] != ' '; i++ {
		d := s[i] - '0'
		if d > 9 || i == 18 {
			return 0, "", false
		}
		v = v*10 + int64(d)
	}
	if i == 0 {
		return 0, "", false
	}
	if i < len(s) {
		i++
	}
	return v, s[i:], true
}

// totalsOf reads a cell's numbers as the scripts return them: t, the
// previous t, the record, n, g and the previous g.
func totalsOf(v [6]int64) engine.Totals {
	return engine.Totals{Cur: v[0], Prev: v[1], Mine: v[2], Shared: v[3] > 1, Processes: v[3], Global: v[4], GlobalPrev: v[5]}
}

// refusedCells is the error of a script that refused some cells: their
// keys hold another type, or Redis is at its memory limit under
// noeviction (OOM), which refuses writes until it has room. It is a Redis
// reply about those cells, not a Redis that does not answer, so the
// breaker does not hold it against the endpoint, and the cells' units stay
// pending for the next replay.
type refusedCells int

func (n refusedCells) Error() string {
	return fmt.Sprintf("Redis refused %d cells (a key holds another type, or Redis is out of memory under maxmemory-policy noeviction)", int(n))
}

// RedisError makes refusedCells a redis.Error.
func (refusedCells) RedisError() {}
