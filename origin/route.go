package origin

import (
	"encoding/binary"

	"github.com/edgelimit/caddy-ratelimit/engine"
)

// route picks the endpoint of key by rendezvous (highest random weight)
// hashing of (namespace, identifier) against each endpoint's label: every
// window and sequence of one identifier goes to the same endpoint, every
// process that lists the same partitions agrees without coordination, and
// removing a partition moves only its own keys.
func (r *Redis) route(key engine.Key) *endpoint { return r.endpoints[r.Partition(key)] }

// Partitions is how many partitions (redis lines) the origin has: each
// fails apart, and the engine keeps its record of failures per partition
// (engine.Partitioned).
func (r *Redis) Partitions() int { return len(r.endpoints) }

// Partition is the index of key's partition among the origin's endpoints:
// the one route picks.
func (r *Redis) Partition(key engine.Key) int {
	if len(r.endpoints) == 1 {
		return 0
	}
	h := keyHash(key.Namespace, key.Identifier)
	best := 0
	bestScore := mix64(h ^ r.endpoints[0].seed)
	for i, ep := range r.endpoints[1:] {
		if s := mix64(h ^ ep.seed); s > bestScore {
			best, bestScore = i+1, s
		}
	}
	return best
}

// FNV-1a, 64 bit: stable across processes and Go versions (unlike
// hash/maphash, which is seeded per process), which placement needs.
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

func fnv64a(h uint64, s string) uint64 {
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= fnvPrime
	}
	return h
}

// keyHash hashes (namespace, identifier) with the namespace's length first,
// so ("a", "bc") and ("ab", "c") differ.
func keyHash(ns, id string) uint64 {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(ns)))
	h := fnv64a(fnvOffset, string(n[:]))
	h = fnv64a(h, ns)
	return fnv64a(h, id)
}

func labelHash(kind, label string) uint64 {
	return mix64(fnv64a(fnv64a(fnvOffset, kind), label))
}

// mix64 is MurmurHash3's 64-bit finalizer: FNV's low bits are weak, and
// rendezvous scores must look independent per endpoint.
func mix64(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}
