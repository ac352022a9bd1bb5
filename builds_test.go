package ratelimit

import (
	"context"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	logobserver "go.uber.org/zap/zaptest/observer"

	"github.com/edgelimit/caddy-ratelimit/internal/redistest"
	"github.com/edgelimit/caddy-ratelimit/origin"
)

// TestBuildName_NamesTheModulesBuild: a Caddy built with the module as a
// dependency is named by the module's version; a build of this
// repository by its commit, marked when it had changes not committed.
func TestBuildName_NamesTheModulesBuild(t *testing.T) {
	for _, c := range []struct {
		name string
		info debug.BuildInfo
		want string
	}{
		{"xcaddy", debug.BuildInfo{Main: debug.Module{Path: "caddy"},
			Deps: []*debug.Module{{Path: "github.com/other/x", Version: "v9.9.9"}, {Path: modulePath, Version: "v0.0.0-20261128044500-00311d9abcde"}}}, "v0.0.0-20261128044500-00311d9abcde"},
		{"replaced by a directory", debug.BuildInfo{Main: debug.Module{Path: "caddy"},
			Deps: []*debug.Module{{Path: modulePath, Version: "v1.0.0", Replace: &debug.Module{Path: "../rl"}}}}, "v1.0.0+replaced"},
		{"a clone", debug.BuildInfo{Main: debug.Module{Path: modulePath, Version: "(devel)"},
			Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "405d1c2f00112233445566778899aabbccddeeff"}, {Key: "vcs.modified", Value: "false"}}}, "405d1c2f0011"},
		{"a clone with changes", debug.BuildInfo{Main: debug.Module{Path: modulePath, Version: "(devel)"},
			Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "405d1c2f00112233445566778899aabbccddeeff"}, {Key: "vcs.modified", Value: "true"}}}, "405d1c2f0011+dirty"},
		{"neither", debug.BuildInfo{Main: debug.Module{Path: modulePath, Version: "(devel)"}}, "devel"},
	} {
		if got := nameBuild(&c.info); got != c.want {
			t.Errorf("%s: named %q, want %q", c.name, got, c.want)
		}
	}
}

// TestBuilds_TheRegionRunningTwoBuildsIsLogged: a node left behind by a
// deploy ran an older build beside the others with nothing to say so. A
// node now reads the region's builds at its first heartbeat and every 30
// after, warns when there are several, and says when there is one again.
func TestBuilds_TheRegionRunningTwoBuildsIsLogged(t *testing.T) {
	srv := redistest.Start(t)
	cfg := origin.Config{Redis: []string{srv.URL()}}
	newO := func(node, build string) *origin.Redis {
		o, err := origin.New(cfg, origin.Options{NodeID: node, Build: build})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = o.Close() })
		if _, err := o.Heartbeat(context.Background(), time.Minute); err != nil {
			t.Fatal(err)
		}
		return o
	}
	this, old, unnamed := newO("this", buildName()), newO("old", "v0.9.0"), newO("older", "")
	core, logs := logobserver.New(zapcore.InfoLevel)
	w := &buildsWatch{o: this, log: zap.New(core)}
	w.beat()
	warned := logs.FilterMessageSnippet("more than one build").All()
	if len(warned) != 1 || logs.Len() != 1 {
		t.Fatalf("%d warnings of several builds, want 1", len(warned))
	}
	shown, _ := warned[0].ContextMap()["builds"].([]any)
	// In the order of the builds' names; none first.
	named := []string{buildName() + " (1)", "v0.9.0 (1)"}
	slices.Sort(named)
	want := []any{unnamedBuild + " (1)", named[0], named[1]}
	if !slices.Equal(shown, want) {
		t.Fatalf("the warning names builds %v, want %v", shown, want)
	}
	if n := len(this.Stats().Builds); n != 3 {
		t.Fatalf("the status counts %d builds, want 3", n)
	}
	for range buildsEvery - 1 {
		w.beat() // no read, no line
	}
	if logs.Len() != 1 {
		t.Fatalf("%d lines between two reads", logs.Len())
	}
	for _, o := range []*origin.Redis{old, unnamed} {
		if err := o.Leave(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	w.beat()
	if n := logs.FilterMessageSnippet("one build again").Len(); n != 1 {
		t.Fatalf("%d lines saying the region runs one build again, want 1", n)
	}
	w.beat()
	for range buildsEvery {
		w.beat()
	}
	if n := logs.Len(); n != 2 {
		t.Fatalf("%d lines after the region ran one build again and the watch read it again, want the 2", n)
	}
}

// TestBuilds_AUserWithoutZRANGEIsToldOnce: the README listed the commands
// the Redis user needs on the processes key without ZRANGE; a user given
// exactly those kept the heartbeat and lost the check of builds, its
// status's builds null, with nothing logged. The refusal is now logged
// once, and the recovery once.
func TestBuilds_AUserWithoutZRANGEIsToldOnce(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	admin := srv.Client()
	if err := admin.Do(ctx, "ACL", "SETUSER", "app", "on", ">app-pw", "~*", "&*", "+@all", "-zrange").Err(); err != nil {
		t.Fatal(err)
	}
	url := strings.Replace(srv.URL(), "redis://", "redis://app:app-pw@", 1)
	o, err := origin.New(origin.Config{Redis: []string{url}}, origin.Options{NodeID: "n", Build: buildName()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = o.Close() })
	if _, err := o.Heartbeat(ctx, time.Minute); err != nil {
		t.Fatalf("the heartbeat needs no ZRANGE: %v", err)
	}
	core, logs := logobserver.New(zapcore.InfoLevel)
	w := &buildsWatch{o: o, log: zap.New(core)}
	for range 2 * buildsEvery {
		w.beat()
	}
	if n := logs.FilterMessageSnippet("needs ZRANGE").Len(); n != 1 || logs.Len() != 1 {
		t.Fatalf("%d warnings naming ZRANGE in %d lines over two reads, want 1 in 1", n, logs.Len())
	}
	if err := admin.Do(ctx, "ACL", "SETUSER", "app", "+zrange").Err(); err != nil {
		t.Fatal(err)
	}
	for range buildsEvery {
		w.beat()
	}
	if n := logs.FilterMessageSnippet("reading the region's builds again").Len(); n != 1 {
		t.Fatalf("%d lines saying the builds are read again, want 1", n)
	}
	if n := len(o.Stats().Builds); n != 1 {
		t.Fatalf("the status counts %d builds once ZRANGE is allowed, want 1", n)
	}
}
