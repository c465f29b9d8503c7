// Package config loads a process's configuration from, in rising priority:
// the defaults bound to a flag.FlagSet, an optional YAML file (--config),
// CRESCENT_* environment variables, and command-line flags. YAML keys and
// environment names derive from flag names: flag "suspect-after" is YAML key
// "suspect-after" and env CRESCENT_SUSPECT_AFTER. The caller validates the
// result (each service's Config has a Validate method).
//
// Internal to the Crescent module: the services, the CLI and pkg/client
// import it; other modules cannot, so it may change in any release.
package config

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// EnvPrefix prefixes every environment variable Crescent reads.
const EnvPrefix = "CRESCENT_"

// EnvName returns the environment variable for a flag name.
func EnvName(flagName string) string {
	return EnvPrefix + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// Load parses args into fs, then fills every flag not given on the command
// line from the environment, then from the YAML file named by the "config"
// flag (which Load registers). lookupEnv is os.LookupEnv in production.
func Load(fs *flag.FlagSet, args []string, lookupEnv func(string) (string, bool)) error {
	var file string
	if fs.Lookup("config") == nil {
		fs.StringVar(&file, "config", "", "optional YAML config file (keys are flag names)")
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if !set["config"] {
		if v, ok := lookupEnv(EnvName("config")); ok {
			file = v
		}
	}
	fromEnv := map[string]bool{}
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] || f.Name == "config" {
			return
		}
		if v, ok := lookupEnv(EnvName(f.Name)); ok {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("env %s: %w", EnvName(f.Name), err))
			}
			fromEnv[f.Name] = true
		}
	})
	if file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return fmt.Errorf("config file: %w", err)
		}
		var m map[string]any
		if err := yaml.Unmarshal(b, &m); err != nil {
			return fmt.Errorf("config file %s: %w", file, err)
		}
		for k, v := range m {
			f := fs.Lookup(k)
			if f == nil {
				errs = append(errs, fmt.Errorf("config file %s: unknown key %q", file, k))
				continue
			}
			if set[k] || fromEnv[k] {
				continue
			}
			if err := fs.Set(k, scalar(v)); err != nil {
				errs = append(errs, fmt.Errorf("config file %s: key %q: %w", file, k, err))
			}
		}
	}
	return errors.Join(errs...)
}

func scalar(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case []any:
		parts := make([]string, len(x))
		for i, p := range x {
			parts[i] = scalar(p)
		}
		return strings.Join(parts, ",")
	default:
		return fmt.Sprint(x)
	}
}

// ByteSize is a flag.Value for sizes such as "512MiB", "4GiB", "1G" or "4096".
type ByteSize uint64

var units = []struct {
	suffix string
	mult   uint64
}{
	{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
	{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
	{"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"T", 1 << 40}, {"B", 1},
}

// ParseByteSize parses a size with an optional unit suffix.
func ParseByteSize(s string) (ByteSize, error) {
	t := strings.TrimSpace(s)
	mult := uint64(1)
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	n, err := strconv.ParseFloat(t, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("invalid size %q (want e.g. 4096, 512MiB, 4GiB)", s)
	}
	return ByteSize(n * float64(mult)), nil
}

func (b *ByteSize) String() string {
	v := uint64(*b)
	for _, u := range []struct {
		s string
		m uint64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if v >= u.m && v%u.m == 0 {
			return strconv.FormatUint(v/u.m, 10) + u.s
		}
	}
	return strconv.FormatUint(v, 10)
}

// Set implements flag.Value.
func (b *ByteSize) Set(s string) error {
	v, err := ParseByteSize(s)
	if err != nil {
		return err
	}
	*b = v
	return nil
}

// Type names the value kind for pflag (cobra) help output.
func (b *ByteSize) Type() string { return "size" }
