//go:build race

package testcluster_test

const raceEnabled = true
