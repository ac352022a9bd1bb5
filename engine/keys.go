package engine

import (
	"crypto/sha256"
	"encoding/hex"
)

// MaxIdentifierLen is the longest identifier kept as it is. Longer ones are
// replaced by a hash so that memory per entry stays bounded whatever clients
// send; 64 bytes holds every common API key format and an IPv6 prefix.
const MaxIdentifierLen = 64

// hashedPrefix starts every hashed identifier. A hashed identifier is
// 1 + 64 bytes long, one byte more than any identifier kept as it is, so a
// hash can never equal a raw identifier.
const hashedPrefix = "#"

// NormalizeIdentifier returns id itself when it is at most MaxIdentifierLen
// bytes long, and otherwise "#" followed by the hex SHA-256 of id (65 bytes).
// The mapping is injective up to SHA-256 collisions: a raw identifier is never
// 65 bytes long.
func NormalizeIdentifier(id string) string {
	if len(id) <= MaxIdentifierLen {
		return id
	}
	sum := sha256.Sum256([]byte(id))
	return hashedPrefix + hex.EncodeToString(sum[:])
}

// findKey returns the zone and normalized identifier of key, if the zone
// exists.
func (e *Engine) findKey(key Key) (*Zone, string, bool) {
	z, ok := e.lookupZone(key)
	return z, NormalizeIdentifier(key.Identifier), ok
}
