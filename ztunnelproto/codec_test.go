package ztunnelproto

import (
	"bytes"
	"errors"
	"testing"

	"google.golang.org/protobuf/proto"
)

// The bytes real ztunnel sends and expects; any drift breaks interop.
func TestWireBytes(t *testing.T) {
	info := &WorkloadInfo{Name: "n", Namespace: "s", ServiceAccount: "a"}
	tests := []struct {
		name string
		msg  proto.Message
		want []byte
	}{
		{"hello", HelloV1(), []byte{0x08, 0x01}},
		{"ack", AckResponse(""), []byte{0x0a, 0x00}},
		{"nack e", AckResponse("e"), []byte{0x0a, 0x03, 0x0a, 0x01, 0x65}},
		{"snapshot sent", SnapshotSentRequest(), []byte{0x1a, 0x00}},
		{"del x", DelRequest("x"), []byte{0x12, 0x03, 0x12, 0x01, 0x78}},
		{"keep x", KeepRequest("x"), []byte{0x2a, 0x03, 0x0a, 0x01, 0x78}},
		{"add u", AddRequest("u", info), []byte{0x0a, 0x0e, 0x0a, 0x01, 0x75, 0x12, 0x09, 0x0a, 0x01, 0x6e, 0x12, 0x01, 0x73, 0x1a, 0x01, 0x61}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Marshal(tt.msg)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, tt.want) {
				t.Fatalf("encode: got % x, want % x", got, tt.want)
			}
			// And the reverse: the decoder understands the reference bytes.
			back := tt.msg.ProtoReflect().New().Interface()
			if err := proto.Unmarshal(tt.want, back); err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(back, tt.msg) {
				t.Fatalf("decode % x: got %v, want %v", tt.want, back, tt.msg)
			}
		})
	}
}

func TestDecodeRequest(t *testing.T) {
	tests := []struct {
		name    string
		in      []byte
		wantOp  string
		wantUID string
		wantErr bool
	}{
		{"del", []byte{0x12, 0x03, 0x12, 0x01, 0x78}, OpDel, "x", false},
		{"keep", []byte{0x2a, 0x03, 0x0a, 0x01, 0x78}, OpKeep, "x", false},
		{"snapshot sent", []byte{0x1a, 0x00}, OpSnapshotSent, "", false},
		{"empty oneof", []byte{}, "", "", true},
		{"unknown field only", []byte{0x38, 0x01}, "", "", true},
		{"garbage", []byte{0xff, 0xff, 0xff}, "", "", true},
		{"truncated length", []byte{0x12, 0x09, 0x12}, "", "", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := DecodeRequest(tt.in)
			if tt.wantErr {
				if !errors.Is(err, ErrProtocol) {
					t.Fatalf("got %v, %v; want ErrProtocol", r, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if RequestOp(r) != tt.wantOp || RequestUID(r) != tt.wantUID {
				t.Fatalf("got %s %q, want %s %q", RequestOp(r), RequestUID(r), tt.wantOp, tt.wantUID)
			}
		})
	}
}

func TestDecodeResponseAndHello(t *testing.T) {
	if ack, err := DecodeResponse([]byte{0x0a, 0x03, 0x0a, 0x01, 0x65}); err != nil || ack.GetError() != "e" {
		t.Fatalf("nack: %v %v", ack, err)
	}
	if _, err := DecodeResponse([]byte{}); !errors.Is(err, ErrProtocol) {
		t.Fatalf("response without ack: %v", err)
	}
	if _, err := DecodeResponse([]byte{0xde, 0xad}); !errors.Is(err, ErrProtocol) {
		t.Fatalf("garbage response: %v", err)
	}
	if h, err := DecodeHello([]byte{0x08, 0x01}); err != nil || h.GetVersion() != Version_V1 {
		t.Fatalf("hello: %v %v", h, err)
	}
	if _, err := DecodeHello([]byte{0x0a, 0x00}); !errors.Is(err, ErrProtocol) {
		t.Fatalf("ack as hello: %v", err)
	}
}
