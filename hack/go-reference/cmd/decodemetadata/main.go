// Command decodemetadata reads a device metadata file the way Go consumers of
// k8s.io/dynamic-resource-allocation do, so Tandem's files are checked by the library's own
// decoder rather than by Tandem's reading of it (tests/integration/test_metadata_go_decoder.py).
//
// Usage: decodemetadata FILE
//
// It prints one JSON object:
//
//   - "consumers": for each supported version (metadata.resource.k8s.io/v1beta1 and v1alpha1),
//     what a consumer asking for that version gets from the whole stream
//     (devicemetadata.DecodeMetadataFromStream into that version's type): the object, and the
//     version of the stream entry it was decoded from;
//   - "objects": every entry of the stream decoded on its own into the type of its own version,
//     with the library's validation result ("validation": "valid", or the errors), so each entry
//     is checked against the rules of the version it claims to be.
//
// Any decoding failure is printed on stderr and exits 1.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	metadatav1alpha1 "k8s.io/dynamic-resource-allocation/api/metadata/v1alpha1"
	metadatav1beta1 "k8s.io/dynamic-resource-allocation/api/metadata/v1beta1"
	"k8s.io/dynamic-resource-allocation/devicemetadata"
)

// decoded is one result: the object, the stream entry's version it came from, and (for
// "objects") what validation said.
type decoded struct {
	DecodedFrom string         `json:"decodedFrom"`
	Validation  string         `json:"validation,omitempty"`
	Object      runtime.Object `json:"object"`
}

// newObject is an empty object of a supported version; nil for a version the library lacks.
func newObject(gv schema.GroupVersion) runtime.Object {
	switch gv {
	case metadatav1alpha1.SchemeGroupVersion:
		return &metadatav1alpha1.DeviceMetadata{}
	case metadatav1beta1.SchemeGroupVersion:
		return &metadatav1beta1.DeviceMetadata{}
	}
	return nil
}

// decode reads the first compatible entry of stream into dest; validate asks for the
// library's validation of that entry too.
func decode(stream []byte, dest runtime.Object, validate bool) (decoded, error) {
	var gvk schema.GroupVersionKind
	var validation error
	opts := []devicemetadata.DecodeMetadataOption{devicemetadata.DecodeMetadataStoreGVKResult(&gvk)}
	if validate {
		opts = append(opts, devicemetadata.DecodeMetadataWithValidationResult(&validation))
	}
	if err := devicemetadata.DecodeMetadataFromStream(json.NewDecoder(bytes.NewReader(stream)), dest, opts...); err != nil {
		return decoded{}, err
	}
	out := decoded{DecodedFrom: gvk.GroupVersion().String(), Object: dest}
	if validation != nil {
		out.Validation = validation.Error()
	} else if validate {
		out.Validation = "valid"
	}
	return out, nil
}

// entries splits the stream into its JSON values, as json.Decoder reads them.
func entries(stream []byte) ([]json.RawMessage, error) {
	var out []json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(stream))
	for dec.More() {
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, err
		}
		out = append(out, raw)
	}
	return out, nil
}

func run(path string) error {
	stream, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	result := struct {
		Consumers map[string]decoded `json:"consumers"`
		Objects   []decoded          `json:"objects"`
	}{Consumers: map[string]decoded{}}
	for _, gv := range []schema.GroupVersion{metadatav1beta1.SchemeGroupVersion, metadatav1alpha1.SchemeGroupVersion} {
		got, err := decode(stream, newObject(gv), false)
		if err != nil {
			return fmt.Errorf("as a %s consumer: %w", gv, err)
		}
		result.Consumers[gv.String()] = got
	}
	raws, err := entries(stream)
	if err != nil {
		return err
	}
	for i, raw := range raws {
		var meta metav1.TypeMeta
		if err := json.Unmarshal(raw, &meta); err != nil {
			return fmt.Errorf("entry %d: %w", i, err)
		}
		gv, err := schema.ParseGroupVersion(meta.APIVersion)
		if err != nil {
			return fmt.Errorf("entry %d: %w", i, err)
		}
		dest := newObject(gv)
		if dest == nil {
			return fmt.Errorf("entry %d: version %q is not one the library supports", i, meta.APIVersion)
		}
		got, err := decode(raw, dest, true)
		if err != nil {
			return fmt.Errorf("entry %d (%s): %w", i, gv, err)
		}
		result.Objects = append(result.Objects, got)
	}
	out := bufio.NewWriter(os.Stdout)
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	if err := enc.Encode(result); err != nil {
		return err
	}
	return out.Flush()
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: decodemetadata FILE")
		os.Exit(2)
	}
	if err := run(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "decodemetadata:", err)
		os.Exit(1)
	}
}
