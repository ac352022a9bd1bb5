package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/edgelimit/caddy-ratelimit/origin"
)

// modulePath is this module's import path, as build information names it.
const modulePath = "github.com/edgelimit/caddy-ratelimit"

// buildName names this process's build of the module among the region's
// processes (origin.Options.Build): the module's version when Caddy was
// built with it as a dependency (xcaddy: a tag, or a pseudo-version that
// holds the commit), the commit when it is the main module (go build
// ./cmd/caddy in a clone; "+dirty" with changes not committed), "devel"
// when neither says.
var buildName = sync.OnceValue(func() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "devel"
	}
	return nameBuild(info)
})

// nameBuild is buildName of the build information given.
func nameBuild(info *debug.BuildInfo) string {
	for _, d := range info.Deps {
		if d.Path == modulePath && d.Version != "" && d.Version != "(devel)" {
			if d.Replace != nil && d.Replace.Version == "" {
				return d.Version + "+replaced"
			}
			return d.Version
		}
	}
	if info.Main.Path == modulePath {
		if info.Main.Version != "" && info.Main.Version != "(devel)" {
			return info.Main.Version
		}
		var rev string
		var dirty bool
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if rev != "" {
			rev = rev[:min(len(rev), 12)]
			if dirty {
				rev += "+dirty"
			}
			return rev
		}
	}
	return "devel"
}

// buildsEvery is how many heartbeats apart a node reads the region's
// builds (origin.Builds, one ZRANGE): a deploy takes minutes, and a
// build left behind stays.
const buildsEvery = 30

// unnamedBuild shows the records of builds that name none.
const unnamedBuild = "unnamed (a build before 2026-11-28)"

// buildsWatch logs when the region's processes come to run more than one
// build, and when they run one again. It runs on the heartbeat's
// goroutine.
type buildsWatch struct {
	o     *origin.Redis
	log   *zap.Logger
	beats int
	last  string // the builds last logged, "" for one
	// refused: the last read got a reply refusing it, already logged.
	refused bool
}

// beat reads the region's builds every buildsEvery heartbeats, the first
// at once.
func (w *buildsWatch) beat() {
	w.beats++
	if w.beats%buildsEvery != 1 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	builds, err := w.o.Builds(ctx)
	var reply redis.Error
	switch {
	case errors.As(err, &reply):
		// A Redis user allowed the heartbeat's commands and not ZRANGE
		// left the status's builds null and the check off with nothing
		// said (an audit). Said once until a read succeeds; a Redis that
		// does not answer has the breakers' lines.
		if !w.refused {
			w.refused = true
			w.log.Warn("cannot read the region's builds, so a region running more than one build is not told: the Redis user needs ZRANGE on the processes key",
				zap.Error(err))
		}
		return
	case err != nil:
		return
	}
	if w.refused {
		w.refused = false
		w.log.Info("reading the region's builds again")
	}
	names := slices.Sorted(maps.Keys(builds))
	shown := make([]string, len(names))
	for i, b := range names {
		if b == "" {
			b = unnamedBuild
		}
		shown[i] = fmt.Sprintf("%s (%d)", b, builds[names[i]])
	}
	now := ""
	if len(builds) > 1 {
		now = strings.Join(shown, ", ")
	}
	if now == w.last {
		return
	}
	w.last = now
	if now != "" {
		w.log.Warn("the region's processes run more than one build: what one build changed (a key's format, a script) the others do not do (finish or roll back the deploy)",
			zap.Strings("builds", shown), zap.String("this", buildName()))
		return
	}
	w.log.Info("the region's processes run one build again", zap.Strings("builds", shown))
}
