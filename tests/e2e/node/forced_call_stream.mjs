// The openai-node SDK's chat stream helper on a forced call with parallel calls allowed (run by
// tests/e2e/test_tool_calls.py with the SDK `./dev test` installs into .tools/agents): it throws
// LengthFinishReasonError on a `length` finish and parses strict tools' arguments; prints the final completion.
const [baseURL, sdk] = process.argv.slice(2); // the SDK's entry module, as a file URL (ESM ignores NODE_PATH)
const { default: OpenAI } = await import(sdk);
const client = new OpenAI({ baseURL, apiKey: "x", maxRetries: 0 });
const stream = client.chat.completions.stream({
  model: "m",
  messages: [{ role: "user", content: "What is the weather in Paris?" }],
  tools: [{
    type: "function",
    function: {
      name: "get_weather",
      description: "Current weather in a city.",
      strict: true,
      parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"], additionalProperties: false },
    },
  }],
  tool_choice: "required",
  max_tokens: 300,
  temperature: 0,
});
const final = await stream.finalChatCompletion();
console.log(JSON.stringify(final));
