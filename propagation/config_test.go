package propagation

import (
	"strings"
	"testing"
	"time"
)

// TestConfig_DefaultsAreValidAndBadValuesAreNamed: a config with only a
// DSN and a region takes every default and is valid; each bad value is
// refused with the setting's name.
func TestConfig_DefaultsAreValidAndBadValuesAreNamed(t *testing.T) {
	base := Config{DSN: "u@tcp(127.0.0.1:3306)/db", Region: "eu-1"}.WithDefaults()
	if err := base.Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	if base.Flush != DefaultFlush || base.GlobalSync != DefaultGlobalSync || base.BlocklistSync != DefaultBlocklistSync ||
		base.Batch != DefaultBatch || base.PublishFloor != DefaultPublishFloor || base.MinWindow != DefaultMinWindow {
		t.Fatalf("defaults not applied: %+v", base)
	}
	atBounds := base
	atBounds.Flush, atBounds.GlobalSync, atBounds.BlocklistSync, atBounds.Timeout = MaxInterval, MaxInterval, MaxInterval, MaxTimeout
	if err := atBounds.Validate(); err != nil {
		t.Fatalf("every interval at its bound: %v", err)
	}
	for _, c := range []struct {
		mod  func(*Config)
		want string
	}{
		{func(c *Config) { c.DSN = "" }, "DSN is empty"},
		{func(c *Config) { c.Region = "" }, "region is required"},
		{func(c *Config) { c.Region = strings.Repeat("r", MaxRegionLen+1) }, "region is longer"},
		{func(c *Config) { c.Flush = time.Millisecond }, "mysql_flush"},
		{func(c *Config) { c.GlobalSync = time.Millisecond }, "global_sync"},
		{func(c *Config) { c.BlocklistSync = 0 }, "blocklist_sync"},
		{func(c *Config) { c.Timeout = time.Millisecond }, "mysql_timeout"},
		{func(c *Config) { c.MinWindow = -time.Second }, "min_window"},
		{func(c *Config) { c.Batch = MaxBatch + 1 }, "mysql_batch"},
		{func(c *Config) { c.Batch = 0 }, "mysql_batch"},
		{func(c *Config) { c.PublishFloor = 1.5 }, "publish_floor"},
		// No upper bound before: `mysql_flush 1000000h` adapted, and the
		// region never published.
		{func(c *Config) { c.Flush = MaxInterval + 1 }, "mysql_flush"},
		{func(c *Config) { c.GlobalSync = MaxInterval + 1 }, "global_sync"},
		{func(c *Config) { c.BlocklistSync = MaxInterval + 1 }, "blocklist_sync"},
		{func(c *Config) { c.Timeout = MaxTimeout + 1 }, "mysql_timeout"},
	} {
		cfg := base
		c.mod(&cfg)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("want an error naming %q, got %v", c.want, err)
		}
	}
}
