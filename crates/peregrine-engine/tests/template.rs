//! Chat templates rendered exactly as transformers renders them.
//!
//! Expected strings were recorded with jinja2 3.1.6 in transformers' environment
//! (`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with loop controls, its
//! `tojson`, `raise_exception` and `strftime_now`); content parts were joined with "\n" first for
//! templates that use content as a string, as vLLM does.

use peregrine_engine::chat_template::{
    CHATML, ChatMessage, ChatTemplate, GEMMA, GEMMA4, TemplateError, fallback_template,
    strftime_utc,
};
use serde_json::{Map, Value, json};

/// SmolLM2-Instruct's template (ChatML with a default system prompt).
const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// In the style of Llama 3.1's template: bos, a dated system header, tools as indented JSON, and
/// a role-order check through `raise_exception`.
const LLAMA3: &str = r#"{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions:\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

/// In the style of Qwen3's template: reasoning split out of earlier assistant turns with
/// `content.split('</think>')`, tool calls and responses, and `enable_thinking`.
const QWEN3: &str = r##"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"##;

/// Block tags on their own lines, without `-`: shows trim_blocks/lstrip_blocks at work, plus
/// content parts iterated by the template itself, Python-printed booleans and a loop control.
const PARTS: &str = "{% for message in messages %}
    {% if message.role == 'system' %}
        {% continue %}
    {% endif %}
<{{ message.role }}>
    {% for part in message.content %}
        {% if part.type == 'text' %}
{{ part.text }}
        {% endif %}
    {% endfor %}
{% endfor %}
flag={{ add_generation_prompt }} none={{ none }}
";

const CHATML_OUT: &str = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nTwo\nparts<|im_end|>\n<|im_start|>assistant\n";
const SMOLLM2_DEFAULT_SYSTEM: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n";
const SMOLLM2_OWN_SYSTEM: &str = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n";
const LLAMA3_OUT: &str = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 29 Nov 2026\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWeather?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
const LLAMA3_TOOLS: &str = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 29 Nov 2026\n\nYou have access to the following functions:\n\n{\n    \"function\": {\n        \"description\": \"Weather for <city> & region\",\n        \"name\": \"get_weather\",\n        \"parameters\": {\n            \"properties\": {\n                \"city\": {\n                    \"type\": \"string\"\n                },\n                \"days\": {\n                    \"default\": 1,\n                    \"type\": \"integer\"\n                }\n            },\n            \"required\": [\n                \"city\"\n            ],\n            \"type\": \"object\"\n        }\n    },\n    \"type\": \"function\"\n}\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWeather in Zürich?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
const QWEN3_NO_THINK: &str = "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nTimes 3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
const QWEN3_TOOLS: &str = "<|im_start|>system\n# Tools\n\n<tools>\n{\"function\": {\"name\": \"get_weather\", \"parameters\": {\"properties\": {\"city\": {\"type\": \"string\"}}, \"type\": \"object\"}}, \"type\": \"function\"}\n</tools><|im_end|>\n<|im_start|>user\nWeather in Zürich?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"n\": 1.5, \"none\": null, \"ok\": true, \"unit\": \"<c>\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 3}\n</tool_response><|im_end|>\n<|im_start|>assistant\n";
const QWEN3_REASONING_LAST: &str = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\ngreet back\n</think>\n\nHello<|im_end|>\n";
const PARTS_OUT: &str = "<user>\na\nb\n<assistant>\nc\nflag=True none=None";

fn messages(v: Value) -> Vec<ChatMessage> {
    serde_json::from_value(v).expect("test messages parse")
}

fn extra(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

fn render(template: &str, msgs: Value, agp: bool, kwargs: Value) -> Result<String, TemplateError> {
    let bos = Some("<|begin_of_text|>".to_owned());
    let eos = Some("<|eot_id|>".to_owned());
    ChatTemplate::new(template, bos, eos)?.render(&messages(msgs), agp, &extra(kwargs))
}

#[test]
fn chatml_joins_text_parts() {
    let msgs = json!([
        {"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Two"},
            {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "parts"}]}
    ]);
    assert_eq!(render(CHATML, msgs, true, json!({})).unwrap(), CHATML_OUT);
}

#[test]
fn smollm2_adds_its_default_system_prompt() {
    let t = ChatTemplate::new(SMOLLM2, None, None).unwrap();
    let msgs = [ChatMessage::text("user", "What is 2+2?")];
    assert_eq!(
        t.render(&msgs, true, &Map::new()).unwrap(),
        SMOLLM2_DEFAULT_SYSTEM
    );
    let msgs = [
        ChatMessage::text("system", "Be brief."),
        ChatMessage::text("user", "Hi"),
        ChatMessage::text("assistant", "Hello."),
    ];
    assert_eq!(
        t.render(&msgs, false, &Map::new()).unwrap(),
        SMOLLM2_OWN_SYSTEM
    );
}

#[test]
fn llama3_style() {
    let msgs = json!([
        {"role": "system", "content": "  You are terse.  \n"}, {"role": "user", "content": "Hi "},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather?"}
    ]);
    let out = render(LLAMA3, msgs, true, json!({"date_string": "29 Nov 2026"})).unwrap();
    assert_eq!(out, LLAMA3_OUT);
}

#[test]
fn llama3_style_tools_use_python_json_layout() {
    // Keys in sorted order: without serde_json's preserve_order, maps come out sorted.
    let tools = json!([{"function": {"description": "Weather for <city> & region",
        "name": "get_weather", "parameters": {"properties": {"city": {"type": "string"},
            "days": {"default": 1, "type": "integer"}}, "required": ["city"], "type": "object"}},
        "type": "function"}]);
    let msgs = json!([{"role": "user", "content": "Weather in Zürich?"}]);
    let kwargs = json!({"date_string": "29 Nov 2026", "tools": tools});
    assert_eq!(render(LLAMA3, msgs, true, kwargs).unwrap(), LLAMA3_TOOLS);
}

#[test]
fn llama3_style_dates_with_strftime_now() {
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let now = || {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        strftime_utc("%d %b %Y", secs)
    };
    let before = now();
    let out = render(LLAMA3, msgs, false, json!({})).unwrap();
    let after = now();
    assert!(
        out.contains(&format!("Today Date: {before}\n"))
            || out.contains(&format!("Today Date: {after}\n")),
        "{out}"
    );
}

#[test]
fn raise_exception_carries_the_message() {
    let msgs = json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]);
    let err = render(LLAMA3, msgs, true, json!({"date_string": "x"})).unwrap_err();
    assert_eq!(
        err,
        TemplateError::Raised(
            "Conversation roles must alternate user/assistant/user/assistant/...".into()
        )
    );
    assert_eq!(
        err.to_string(),
        "Conversation roles must alternate user/assistant/user/assistant/..."
    );
}

#[test]
fn qwen3_style_without_thinking() {
    let msgs = json!([
        {"role": "system", "content": "You are Qwen."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "Times 3?"}
    ]);
    let out = render(QWEN3, msgs, true, json!({"enable_thinking": false})).unwrap();
    assert_eq!(out, QWEN3_NO_THINK);
}

#[test]
fn qwen3_style_tool_calls() {
    let tools = json!([{"function": {"name": "get_weather",
        "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"}}, "type": "function"}]);
    let msgs = json!([
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments":
                {"city": "Zürich", "n": 1.5, "none": null, "ok": true, "unit": "<c>"},
            "name": "get_weather"}, "id": "c1", "type": "function"}]},
        {"role": "tool", "content": "{\"temp\": 3}", "tool_call_id": "c1"}
    ]);
    let kwargs = json!({"enable_thinking": true, "tools": tools});
    assert_eq!(render(QWEN3, msgs, true, kwargs).unwrap(), QWEN3_TOOLS);
}

#[test]
fn qwen3_style_keeps_reasoning_of_the_last_turn() {
    let msgs = json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "\nHello", "reasoning_content": "\ngreet back\n"}
    ]);
    assert_eq!(
        render(QWEN3, msgs, false, json!({})).unwrap(),
        QWEN3_REASONING_LAST
    );
}

#[test]
fn block_whitespace_parts_and_python_literals() {
    let msgs = json!([
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"}]}
    ]);
    assert_eq!(render(PARTS, msgs, true, json!({})).unwrap(), PARTS_OUT);
}

#[test]
fn tojson_options() {
    // A map literal keeps its order in minijinja: this checks our filter does too.
    let t = "{% set x = {'b': ['é', 1], 'a': {}} %}{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(sort_keys=true, ensure_ascii=true) }}|{{ x | tojson(separators=(',', ':')) }}";
    let out = ChatTemplate::new(t, None, None)
        .unwrap()
        .render(&[], false, &Map::new())
        .unwrap();
    let want = [
        r#"{"b": ["é", 1], "a": {}}"#,
        "{\n  \"b\": [\n    \"é\",\n    1\n  ],\n  \"a\": {}\n}",
        r#"{"a": {}, "b": ["\u00e9", 1]}"#,
        r#"{"b":["é",1],"a":{}}"#,
    ];
    assert_eq!(out, want.join("|"));
}

#[test]
fn request_key_order_reaches_the_template() {
    let kwargs: Map<String, Value> = serde_json::from_str(r#"{"x": {"b": 1, "a": 2}}"#).unwrap();
    let t = ChatTemplate::new("{{ x | tojson }}", None, None).unwrap();
    let out = t.render(&[], false, &kwargs).unwrap();
    if kwargs["x"]
        .as_object()
        .and_then(|m| m.keys().next())
        .map(String::as_str)
        == Some("b")
    {
        assert_eq!(out, r#"{"b": 1, "a": 2}"#);
    } else {
        // serde_json without `preserve_order` sorted the keys while parsing the request.
        eprintln!(
            "serde_json/preserve_order is off: tool schemas reach templates with sorted keys"
        );
        assert_eq!(out, r#"{"a": 2, "b": 1}"#);
    }
}

#[test]
fn python_string_methods_and_generation_tags() {
    let t = "{% for m in messages %}{% generation %}{{ m.content.strip().upper() }}|{{ m.content.split(',') | join('+') }}|{{ m.content.startswith(' a') }}{% endgeneration %}{% endfor %}";
    let msgs = [ChatMessage::text("user", " a,b ")];
    let out = ChatTemplate::new(t, None, None)
        .unwrap()
        .render(&msgs, false, &Map::new())
        .unwrap();
    assert_eq!(out, "A,B| a+b |True");
}

#[test]
fn errors_are_reported_not_panicked() {
    assert!(matches!(
        ChatTemplate::new("{%}", None, None),
        Err(TemplateError::Syntax(_))
    ));
    assert!(matches!(
        ChatTemplate::new("{% for %}", None, None),
        Err(TemplateError::Syntax(_))
    ));
    let t = ChatTemplate::new("{{ messages[0].content + 1 }}", None, None).unwrap();
    let err = t
        .render(&[ChatMessage::text("user", "x")], false, &Map::new())
        .unwrap_err();
    assert!(matches!(err, TemplateError::Render(_)), "{err:?}");
}

#[test]
fn strftime_utc_formats_python_directives() {
    // 2023-11-14 22:13:20 UTC, a Tuesday, day 318 of the year.
    let t = 1_700_000_000;
    assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", t), "2023-11-14 22:13:20");
    assert_eq!(
        strftime_utc("%d %b %Y|%d %B %Y|%A %a|%j|%I%p|%y|%e|%%|%Q", t),
        "14 Nov 2023|14 November 2023|Tuesday Tue|318|10PM|23|14|%|%Q"
    );
    assert_eq!(strftime_utc("%d %B %Y %A", 0), "01 January 1970 Thursday");
    assert_eq!(strftime_utc("%Y-%m-%d", 951_782_400), "2000-02-29");
}

#[test]
fn fixture_tokenizer_config_template() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/llama/hf");
    let Ok(text) = std::fs::read_to_string(format!("{dir}/tokenizer_config.json")) else {
        eprintln!("skipping fixture_tokenizer_config_template: {dir} is missing");
        return;
    };
    let config: Value = serde_json::from_str(&text).unwrap();
    let source = config["chat_template"].as_str().unwrap();
    let eos = config["eos_token"].as_str().map(String::from);
    let t = ChatTemplate::new(source, None, eos).unwrap();
    let msgs = [ChatMessage::text(
        "user",
        "Hello, world! What is the capital of France?",
    )];
    // The prompt the fixture's reference logits were computed on (tests/fixtures/README.md).
    let want = "<|im_start|>user\nHello, world! What is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(t.render(&msgs, true, &Map::new()).unwrap(), want);
}

/// Idioms seen in real templates (macros, filtered loops, selectattr, namespace, loop.previtem,
/// Python dict/str methods, slicing, `%`-format); expected output from jinja2 in transformers'
/// environment.
const IDIOMS: &str = r#"{%- macro render_content(content) -%}
    {%- if content is string -%}{{ content | trim }}{%- else -%}
        {%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{% if not loop.last %} {% endif %}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set systems = messages | selectattr('role', 'equalto', 'system') | list -%}
{%- set ns = namespace(n=0, roles=[]) -%}
n_system={{ systems | length }} first={{ (messages | first)['role'] }} last={{ messages[-1].role | upper }}
{% for m in messages | rejectattr('role', 'equalto', 'system') -%}
{%- set ns.n = ns.n + 1 -%}
[{{ loop.index }}/{{ loop.length }}{% if loop.previtem is defined %} after {{ loop.previtem.role }}{% endif %}] {{ m.role | replace('assistant', 'model') | capitalize }}: {{ render_content(m.content) }}
{% endfor -%}
meta={{ meta.get('missing', 'dflt') }} keys={{ meta.keys() | list | join(',') }} items={% for k, v in meta.items() %}{{ k }}={{ v }};{% endfor %}
{{ 'mapping' if meta is mapping }} {{ 'seq' if messages is sequence }} {{ range(3) | list | tojson }} count={{ ns.n }} d={{ undefined_var | default('fallback') }}
{{ "a-b-c".split('-') | reverse | join('') }} {{ "  x  ".lstrip() }}| {{ "Title case".title() }} {{ "%05.1f" | format(3.14159) }} {{ 'abc'[1:] }} {{ [1,2,3] | max }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 2 ** 3 }}
"#;

#[test]
fn jinja_idioms_match_jinja2() {
    let msgs = json!([
        {"role": "system", "content": "  sys  "},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"},
            {"type": "text", "text": "here"}]},
        {"role": "assistant", "content": " ok "}, {"role": "user", "content": "thanks"}
    ]);
    let out = render(IDIOMS, msgs, false, json!({"meta": {"a": 1, "b": "two"}})).unwrap();
    let want = "n_system=1 first=system last=USER\n[1/3] User: look here\n[2/3 after user] Model: ok\n[3/3 after assistant] User: thanks\nmeta=dflt keys=a,b items=a=1;b=two;mapping seq [0, 1, 2] count=3 d=fallback\ncba x  | Title Case 003.1 bc 3 3 1 8";
    assert_eq!(out, want);
}

/// Gemma 4's fallback renders text conversations as jinja2 renders Gemma 4's official template
/// (google-gemma-4-31B-it.jinja, as llama.cpp ships it in the llama-cpp-python 0.3.36 sdist) in
/// transformers' environment (`trim_blocks`, `lstrip_blocks`), thinking off.
#[test]
fn gemma4_fallback_matches_its_official_template() {
    for arch in ["gemma4", "gemma4_text"] {
        assert_eq!(
            fallback_template(arch),
            ("Gemma 4's turns", GEMMA4),
            "{arch}"
        );
    }
    let render = |msgs: Value, generation: bool| {
        let (bos, eos) = (Some("<bos>".to_owned()), Some("<turn|>".to_owned()));
        let template = ChatTemplate::new(GEMMA4, bos, eos).unwrap();
        template
            .render(&messages(msgs), generation, &Map::new())
            .unwrap()
    };
    let with_system = json!([
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": " Weather? \n"}
    ]);
    let turns = "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n\
                 Hello!<turn|>\n<|turn>user\nWeather?<turn|>\n";
    assert_eq!(render(with_system.clone(), false), turns);
    let prompt = format!("{turns}<|turn>model\n<|channel>thought\n<channel|>");
    assert_eq!(render(with_system, true), prompt);
    let alone = json!([{"role": "user", "content": "Hi"}]);
    let want = "<bos><|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>";
    assert_eq!(render(alone, true), want);
}

/// The fallback for models without a template: Gemma's turns for the Gemma family (system
/// message folded into the first user turn, `model` for the assistant, content trimmed), as
/// jinja2 renders Gemma 3's official template in transformers' environment; ChatML for others.
#[test]
fn gemma_fallback_uses_gemma_turns() {
    for arch in ["gemma2", "gemma3", "gemma3_text"] {
        assert_eq!(fallback_template(arch), ("Gemma's turns", GEMMA), "{arch}");
    }
    for arch in ["llama", "qwen3", "mistral", "qwen3moe"] {
        assert_eq!(fallback_template(arch).1, CHATML, "{arch}");
    }
    let gemma = |msgs: Value| {
        let bos = Some("<bos>".to_owned());
        let eos = Some("<eos>".to_owned());
        ChatTemplate::new(GEMMA, bos, eos)?.render(&messages(msgs), true, &Map::new())
    };
    let with_system = json!([
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": " Weather? \n"}
    ]);
    assert_eq!(
        gemma(with_system).unwrap(),
        "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\n\
         Hello!<end_of_turn>\n<start_of_turn>user\nWeather?<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(
        gemma(json!([{"role": "user", "content": "What is 2+2?"}])).unwrap(),
        "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    );
    let err = gemma(json!([{"role": "assistant", "content": "x"}])).unwrap_err();
    assert!(err.to_string().contains("must alternate"), "{err}");
}
