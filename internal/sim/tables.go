package sim

import (
	"fmt"
	"io"
	"sort"
)

// tables are the README's tables, by name.
var tables = map[string]func(w io.Writer, seed uint64) error{}

// TableNames lists the tables PrintTable knows.
func TableNames() []string {
	var out []string
	for n := range tables {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// PrintTable runs and prints the table name.
func PrintTable(w io.Writer, name string, seed uint64) error {
	f, ok := tables[name]
	if !ok {
		return fmt.Errorf("no table %q: want one of %v", name, TableNames())
	}
	return f(w, seed)
}
