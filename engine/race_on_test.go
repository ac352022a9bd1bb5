//go:build race

package engine

// raceEnabled reports whether the race detector is on: it changes what
// allocates, so allocation counts are not checked under it.
const raceEnabled = true
